"""Chrome / Perfetto trace export (Trace Event Format, JSON object form) and its validator.

Layout: pid 0 holds the host threads with op, kernel and compiled-graph slices; each device
gets its own process with an `allocated` counter (and `reserved` on CUDA), step markers,
OOM markers and a marker at the peak. Counters longer than `max_counter_points` are
down-sampled by keeping each bucket's minimum and maximum, so the peak is always kept. A
distributed run's ranks are one trace, a block of processes per rank. The events are written as
they are formatted (`memprof.reporters.chrome_events`), in one time order.
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import IO, Any

from memprof.capture import Capture
from memprof.errors import MemprofError
from memprof.reporters.chrome_events import (
    Block,
    Window,
    counter_blocks,
    mark_block,
    oom_block,
    slice_block,
    write_trace,
)
from memprof.reporters.registry import Reporter, Run, register

DEFAULT_MAX_COUNTER_POINTS = 200_000
SLICES = ("all", "graphs", "none")  # which host slices a trace holds (`--slices`)


@dataclass(frozen=True)
class ChromeOptions:
    max_counter_points: int = DEFAULT_MAX_COUNTER_POINTS  # per counter track (the peak is always kept)
    slices: str = "all"  # SLICES: every op, kernel and graph call; graph calls and their kernels; none
    steps: tuple[int, int] | None = None  # only the steps A..B (counted from 1), else the whole capture


def window(cap: Capture, steps: tuple[int, int] | None) -> Window:
    """The capture's time span in the trace: all of it, or steps A..B (a one-line error naming the
    steps it has where it has not those)."""
    raw = cap.raw
    t0 = cap.info.t_start_ns or (int(raw["t_ns"].min()) if len(raw) else 0)
    if steps is None:
        return Window(t0, 0, len(raw), t0)
    have = {s.step: s for s in cap.steps()} if len(raw) else {}
    a, b = steps
    if a not in have or b not in have:
        span = f"steps {min(have)} to {max(have)}" if have else "no steps"
        raise MemprofError(f"--steps {a}:{b}: this capture has {span}")
    return Window(t0, have[a].start_row, have[b].end_row, have[a].t_start_ns, steps)


def _capture_events(cap: Capture, o: ChromeOptions, pid0: int, shift_us: float, label: str = ""
                    ) -> tuple[list[dict[str, Any]], list[Block]]:
    """One capture's metadata and event blocks: pid `pid0` its host threads, the next one per device."""
    win = window(cap, o.steps)
    meta: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid0, "name": "process_name", "args": {"name": f"{label}host threads (ops, kernels)"}},
        {"ph": "M", "pid": pid0, "name": "process_sort_index", "args": {"sort_index": pid0}}]
    for t in cap.threads:
        meta.append({"ph": "M", "pid": pid0, "tid": int(t["index"]), "name": "thread_name",
                     "args": {"name": f"{t.get('name') or 'thread'} (tid {t.get('tid')})"}})
    blocks = [slice_block(cap, cap.scopes.slice_table(cap.info.t_stop_ns or win.t0_ns), pid0, win, shift_us,
                          o.slices)]
    for k, dev in enumerate(cap.devices, start=1):
        meta.append({"ph": "M", "pid": pid0 + k, "name": "process_name", "args": {"name": f"{label}{dev} memory"}})
        meta.append({"ph": "M", "pid": pid0 + k, "name": "process_sort_index", "args": {"sort_index": pid0 + k}})
        blocks += counter_blocks(cap, dev, pid0 + k, win, shift_us, o.max_counter_points)
        blocks.append(mark_block(cap, dev, pid0 + k, win, shift_us))
    pids = {d: pid0 + k for k, d in enumerate(cap.devices, start=1)}
    blocks.append(oom_block(cap, lambda d: pids.get(d, pid0), win, shift_us))
    return meta, blocks


def _write(cap: Capture, o: ChromeOptions, out: IO[str]) -> None:
    meta, blocks = _capture_events(cap, o, 0, 0.0)
    other = {"generator": f"memprof {cap.meta.get('memprof_version', '')}", "command": cap.meta.get("command"),
             "torch": cap.meta.get("torch_version"), "exact": cap.exact, "caveats": cap.caveats}
    if o.steps:
        other["steps"] = list(o.steps)
    write_trace(out, meta, blocks, other)


def _write_run(run: Run, o: ChromeOptions, out: IO[str]) -> None:
    """One trace of a distributed run: each rank's processes (host threads, one per device) named
    "rank R: ..." and numbered apart, in one timeline. Ranks of one host share its monotonic clock
    and are aligned by it; ranks of several hosts are aligned at their captures' starts (said in
    `otherData`)."""
    caps = run.captures
    starts = {r: c.info.t_start_ns for r, c in caps.items()}
    one_host = len({c.meta.get("hostname") for c in caps.values()}) == 1
    t0 = min(starts.values())
    per = 1 + max(len(c.devices) for c in caps.values())  # pids a rank takes
    meta: list[dict[str, Any]] = []
    blocks: list[Block] = []
    for r, cap in sorted(caps.items()):
        m, b = _capture_events(cap, o, r * per, (starts[r] - t0) / 1000.0 if one_host else 0.0, f"rank {r}: ")
        meta += m
        blocks += b
    first = caps[min(caps)]
    write_trace(out, meta, blocks, {
        "generator": f"memprof {first.meta.get('memprof_version', '')}", "command": first.meta.get("command"),
        "ranks": sorted(caps), "aligned": "by the host's monotonic clock" if one_host else
        "at each rank's capture start (the ranks ran on several hosts)",
        "exact": all(c.exact for c in caps.values()),
        "caveats": {str(r): c.caveats for r, c in sorted(caps.items()) if c.caveats}})


def chrome_trace(source: Capture | Run, **options: Any) -> dict[str, Any]:
    """The trace as Python objects (what the file holds, parsed: for tests and scripts)."""
    out = io.StringIO()
    o = CHROME.make_options(**options)
    if isinstance(source, Run):
        _write_run(source, o, out)
    else:
        _write(source, o, out)
    return dict(json.loads(out.getvalue()))


CHROME = register(Reporter("chrome", "export", ".json", "Chrome/Perfetto trace (Trace Event Format)", ChromeOptions,
                           _write, _write_run))


def validate_chrome_trace(trace: Any) -> list[str]:
    """Rule-based checks of a trace; returns the problems found (empty when valid).

    Object form with a traceEvents list; every event has ph and pid; non-metadata events
    have numeric, non-negative, non-decreasing timestamps; counters are non-negative
    numbers; instants have a valid scope; complete slices nest properly on each thread.
    """
    problems: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not a Trace Event Format object with a traceEvents list"]
    last_ts = -1.0
    slices: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for i, ev in enumerate(trace["traceEvents"]):
        if not isinstance(ev, dict) or "ph" not in ev or "pid" not in ev:
            problems.append(f"event {i}: missing ph or pid")
            continue
        ph = ev["ph"]
        if ph == "M":
            if "name" not in ev or not isinstance(ev.get("args"), dict):
                problems.append(f"event {i}: metadata without name/args")
            continue
        ts = ev.get("ts")
        if not isinstance(ts, (int, float)) or ts < 0:
            problems.append(f"event {i}: bad timestamp {ts!r}")
            continue
        if ts < last_ts:
            problems.append(f"event {i}: timestamp {ts} before the previous {last_ts}")
        last_ts = ts
        if ph == "C":
            args = ev.get("args")
            if not isinstance(args, dict) or not args:
                problems.append(f"event {i}: counter without series")
            elif any(not isinstance(v, (int, float)) or v < 0 for v in args.values()):
                problems.append(f"event {i}: counter {ev.get('name')} has a negative or non-numeric value")
        elif ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"event {i}: slice with bad duration {dur!r}")
                continue
            slices[(ev["pid"], ev.get("tid", 0))].append((float(ts), float(ts) + float(dur), str(ev.get("name"))))
        elif ph in ("i", "I"):
            if ev.get("s", "t") not in ("g", "p", "t"):
                problems.append(f"event {i}: instant with bad scope {ev.get('s')!r}")
        elif ph not in ("B", "E", "b", "e", "n", "s", "t", "f"):
            problems.append(f"event {i}: unknown phase {ph!r}")
    eps = 1e-3  # timestamps are rounded to 1 ns (0.001 us)
    for (pid, tid), items in slices.items():
        stack: list[tuple[float, float, str]] = []
        for b, e, name in sorted(items, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1][1] <= b + eps:
                stack.pop()
            if stack and e > stack[-1][1] + eps:
                problems.append(f"pid {pid} tid {tid}: slice {name!r} [{b}, {e}] overlaps {stack[-1][2]!r} "
                                f"[{stack[-1][0]}, {stack[-1][1]}] without nesting")
                continue
            stack.append((b, e, name))
    return problems
