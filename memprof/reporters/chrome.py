"""Chrome / Perfetto trace export (Trace Event Format, JSON object form) and its validator.

Layout: pid 0 holds the host threads with op, kernel and compiled-graph slices; each device
gets its own process with an `allocated` counter (and `reserved` on CUDA), step markers,
OOM markers and a marker at the peak. Counters longer than `max_counter_points` are
down-sampled by keeping each bucket's minimum and maximum, so the peak is always kept.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from memprof._events import Kind, device_name
from memprof.analysis.attribution import CATEGORIES, Category, category_series
from memprof.analysis.scopes import Slice
from memprof.analysis.timeline import downsample
from memprof.analysis.units import fmt_bytes
from memprof.capture import Capture
from memprof.reporters.registry import register

DEFAULT_MAX_COUNTER_POINTS = 200_000


def _category(name: str) -> str:
    if name.startswith("## Call CompiledFxGraph"):
        return "compiled_graph"
    if name.startswith(("triton_", "cpp_fused", "cuda_fused")):
        return "kernel"
    if name.startswith("autograd::engine"):
        return "backward"
    if name.startswith("aten::"):
        return "op"
    return "scope"


Us = Callable[[Any], Any]  # steady-clock ns -> trace microseconds


SLICES = ("all", "graphs", "none")  # which host slices a trace holds (`--slices`)


def _slice_events(cap: Capture, us: Us, t0: int, which: str = "all") -> list[dict[str, Any]]:
    """Every scope as a complete ("X") event on its thread, with the FX nodes of kernels; `which`:
    "graphs" keeps compiled-graph calls and their kernels (no eager ops), "none" no slice at all
    (a long capture's trace: its counters and markers only)."""
    events: list[dict[str, Any]] = []
    if which == "none":
        return events
    slices = cap.scopes.slices(cap.info.t_stop_ns or t0)
    kernel_nodes = _kernel_nodes(cap, slices)
    for i, sl in enumerate(slices):
        name = cap.scope_name(sl.scope)
        if which == "graphs" and _category(name) not in ("compiled_graph", "kernel") and i not in kernel_nodes:
            continue
        dur = round((sl.t_end_ns - sl.t_begin_ns) / 1000.0, 3)
        ev: dict[str, Any] = {"ph": "X", "pid": 0, "tid": sl.thread, "name": name, "cat": _category(name),
                              "ts": float(us(sl.t_begin_ns)), "dur": float(dur)}
        args: dict[str, Any] = {}
        if not sl.closed:
            args["closed"] = False
        if i in kernel_nodes:
            args["graph"], args["fx_nodes"] = kernel_nodes[i]
        if args:
            ev["args"] = args
        events.append(ev)
    return events


def _counter(pid: int, name: str, ts: Any, values: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "C", "pid": pid, "name": name, "ts": max(ts, 0.0), "args": values}


def _memory_counters(cap: Capture, pid: int, dev: str, us: Us, max_counter_points: int) -> list[dict[str, Any]]:
    """Allocated bytes, bytes by category and reserved bytes on one device, downsampled."""
    tl = cap.timeline(dev)
    keep = downsample(tl.allocated, max_counter_points)
    events = [_counter(pid, "allocated", 0.0, {"bytes": tl.baseline})]
    for ts, v in zip(us(tl.t_ns[keep]).tolist(), tl.allocated[keep].tolist(), strict=True):
        events.append(_counter(pid, "allocated", ts, {"bytes": v}))
    series = category_series(tl, cap.labels(dev), keep)
    present = [c for c in range(len(CATEGORIES)) if series[:, c].any() or c == Category.UNATTRIBUTED]
    events.append(_counter(pid, "by category", 0.0,
                           {CATEGORIES[c]: (tl.baseline if c == Category.UNATTRIBUTED else 0) for c in present}))
    for ts, vals in zip(us(tl.t_ns[keep]).tolist(), series[:, present].tolist(), strict=True):
        events.append(_counter(pid, "by category", ts, {CATEGORIES[c]: v for c, v in zip(present, vals, strict=True)}))
    if tl.has_reserved:
        events.append(_counter(pid, "reserved", 0.0, {"bytes": tl.reserved_baseline}))
        rkeep = downsample(tl.reserved, max_counter_points)
        for ts, v in zip(us(tl.reserved_t_ns[rkeep]).tolist(), tl.reserved[rkeep].tolist(), strict=True):
            events.append(_counter(pid, "reserved", ts, {"bytes": v}))
    return events


def _instant(pid: int, name: str, cat: str, ts: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "i", "s": "p", "pid": pid, "tid": 0, "name": name, "cat": cat, "ts": max(ts, 0.0), "args": args}


def _device_marks(cap: Capture, pid: int, dev: str, us: Us) -> list[dict[str, Any]]:
    """The peak and the step markers on one device's process."""
    raw, tl = cap.raw, cap.timeline(dev)
    events: list[dict[str, Any]] = []
    if tl.peak_pos >= 0:
        row = int(tl.rows[tl.peak_pos])
        bound = "" if cap.exact else " (lower bound)"
        events.append(_instant(pid, f"peak {fmt_bytes(tl.peak)}{bound}", "peak", float(us(tl.t_ns[tl.peak_pos])),
                               {"bytes": tl.peak, "scope": cap.scope_name(int(raw["scope"][row])),
                                "stack": " > ".join(cap.scope_stack_at_peak(dev))}))
    for r in np.flatnonzero(raw["kind"] == Kind.STEP):
        events.append(_instant(pid, f"step {int(raw['bytes'][r])}", "step", float(us(raw["t_ns"][r])),
                               {"allocated": tl.allocated_before_row(int(r) + 1)}))
    return events


def chrome_trace(cap: Capture, max_counter_points: int = DEFAULT_MAX_COUNTER_POINTS, slices: str = "all"
                 ) -> dict[str, Any]:
    raw = cap.raw
    t0 = cap.info.t_start_ns or (int(raw["t_ns"].min()) if len(raw) else 0)

    def us(t: int | np.ndarray) -> Any:
        return np.round((np.asarray(t, dtype=np.int64) - t0) / 1000.0, 3)

    meta_events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "host threads (ops, kernels)"}},
        {"ph": "M", "pid": 0, "name": "process_sort_index", "args": {"sort_index": 0}},
    ]
    for t in cap.threads:
        label = t.get("name") or "thread"
        meta_events.append({"ph": "M", "pid": 0, "tid": int(t["index"]), "name": "thread_name",
                            "args": {"name": f"{label} (tid {t.get('tid')})"}})
    events = _slice_events(cap, us, t0, slices)
    for pid, dev in enumerate(cap.devices, start=1):
        meta_events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"{dev} memory"}})
        meta_events.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
        events += _memory_counters(cap, pid, dev, us, max_counter_points) + _device_marks(cap, pid, dev, us)
    for r in np.flatnonzero(raw["kind"] == Kind.OOM):
        dev = device_name(int(raw["device_type"][r]), int(raw["device_index"][r]))
        pid = cap.devices.index(dev) + 1 if dev in cap.devices else 0
        events.append(_instant(pid, "OUT OF MEMORY", "oom", float(us(raw["t_ns"][r])),
                               {"requested": int(raw["bytes"][r])}))
    # one global time order; slices that start together: the outer (longer) one first
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    return {
        "traceEvents": meta_events + events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": f"memprof {cap.meta.get('memprof_version', '')}",
                      "command": cap.meta.get("command"), "torch": cap.meta.get("torch_version"),
                      "exact": cap.exact, "caveats": cap.caveats},
    }


def chrome_trace_ranks(caps: dict[int, Capture], max_counter_points: int = DEFAULT_MAX_COUNTER_POINTS,
                       slices: str = "all") -> dict[str, Any]:
    """One trace of a distributed run: each rank's processes (host threads, one per device) renamed
    "rank R: ..." and numbered apart, in one timeline. Ranks of one host share its monotonic clock
    and are aligned by it; ranks of several hosts are aligned at their captures' starts (said in
    `otherData`)."""
    starts = {r: c.info.t_start_ns for r, c in caps.items()}
    one_host = len({c.meta.get("hostname") for c in caps.values()}) == 1
    t0 = min(starts.values())
    per = 1 + max(len(c.devices) for c in caps.values())  # pids a rank takes
    meta_events: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for r, cap in sorted(caps.items()):
        trace = chrome_trace(cap, max_counter_points, slices)
        shift = (starts[r] - t0) / 1000.0 if one_host else 0.0
        for ev in trace["traceEvents"]:
            ev = {**ev, "pid": r * per + int(ev["pid"])}
            if ev["ph"] == "M":
                if ev["name"] == "process_name":
                    ev["args"] = {"name": f"rank {r}: {ev['args']['name']}"}
                elif ev["name"] == "process_sort_index":
                    ev["args"] = {"sort_index": ev["pid"]}
                meta_events.append(ev)
            else:
                ev["ts"] = round(float(ev["ts"]) + shift, 3)
                events.append(ev)
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    first = caps[min(caps)]
    return {
        "traceEvents": meta_events + events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": f"memprof {first.meta.get('memprof_version', '')}",
                      "command": first.meta.get("command"), "ranks": sorted(caps),
                      "aligned": "by the host's monotonic clock" if one_host else
                                 "at each rank's capture start (the ranks ran on several hosts)",
                      "exact": all(c.exact for c in caps.values()),
                      "caveats": {str(r): c.caveats for r, c in sorted(caps.items()) if c.caveats}},
    }


def _kernel_nodes(cap: Capture, slices: list[Slice]) -> dict[int, tuple[str, str]]:
    """Slice index -> (graph, FX nodes) for kernel and extern-op slices directly inside a graph call."""
    if not cap.graphs:
        return {}
    graphs = {g.scope_name: g for g in cap.graphs}
    out: dict[int, tuple[str, str]] = {}
    open_call: dict[int, tuple[int, Any, dict[str, int]]] = {}  # thread -> (depth, graph, occurrences)
    order = sorted(range(len(slices)), key=lambda i: (slices[i].thread, slices[i].t_begin_ns, slices[i].depth))
    for i in order:
        sl = slices[i]
        name = cap.scope_name(sl.scope)
        if name in graphs:
            open_call[sl.thread] = (sl.depth, graphs[name], {})
            continue
        current = open_call.get(sl.thread)
        if current is None or sl.depth != current[0] + 1:
            continue
        _, graph, seen = current
        calls = graph.wrapper.calls_by_scope.get(name, [])
        k = seen.get(name, 0)
        seen[name] = k + 1
        if k >= len(calls):
            continue
        call = graph.wrapper.calls[calls[k]]
        bufs = [call.out] if call.out else [b for b, w in graph.wrapper.writer.items() if w == call.index]
        nodes = [n for b in bufs for n in graph.origins.get(b, [])]
        if nodes:
            out[i] = (f"{graph.role} {graph.key}", ", ".join(dict.fromkeys(nodes)))
    return out


@register("chrome", "export", ".json", "Chrome/Perfetto trace (Trace Event Format)")
def render_chrome(cap: Capture, max_counter_points: int = DEFAULT_MAX_COUNTER_POINTS, slices: str = "all") -> str:
    return json.dumps(chrome_trace(cap, max_counter_points, slices), separators=(",", ":"))


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
