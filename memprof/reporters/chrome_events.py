"""The Chrome trace's events in columns, written as they are formatted (`memprof.reporters.chrome`).

A long capture holds hundreds of thousands of op and kernel slices and as many counter points;
building a dict per event and one JSON string of them all took seconds and a gigabyte. Here each
kind of event is a `Block` of arrays (time, a tie key, what its JSON needs); the blocks are merged
into one time order by a stable sort of their keys, and written a chunk of events at a time, each
chunk formatted kind by kind from the arrays. Memory is a few arrays the length of the events,
whatever the trace's size.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from memprof._events import Kind, device_name
from memprof.analysis.attribution import CATEGORIES, Category, category_series, category_start
from memprof.analysis.scopes import SliceTable
from memprof.analysis.units import fmt_bytes
from memprof.analysis.view import downsample
from memprof.capture import Capture
from memprof.plans import CompiledGraph

CHUNK = 1 << 16  # events formatted at once


@dataclass(frozen=True)
class Block:
    """Events of one kind: their times (microseconds, rounded to 1 ns), a tie key among events at
    one time (a slice's negated duration: the outer slice first), and `lines(indices)`, their JSON
    objects in the order asked."""

    ts: np.ndarray
    tie: np.ndarray
    lines: Callable[[np.ndarray], list[str]]


@dataclass(frozen=True)
class Window:
    """The part of a capture a trace holds: all of it, or the steps `steps`: the event rows from
    `lo_row` to `hi_row` (the last step's marker), starting at time `lo_ns`."""

    t0_ns: int  # time zero of the trace
    lo_row: int
    hi_row: int
    lo_ns: int
    steps: tuple[int, int] | None = None


def write_trace(out: IO[str], meta: Sequence[dict[str, Any]], blocks: Sequence[Block], other: dict[str, Any]) -> None:
    """The trace in the Trace Event Format's object form: metadata events, then every block's events
    in one time order (stable: at one time and tie, in the order of `blocks`)."""
    out.write('{"traceEvents":[\n')
    first = True
    for m in meta:
        out.write(("" if first else ",\n") + json.dumps(m, separators=(",", ":")))
        first = False
    keyed = [b for b in blocks if len(b.ts)]
    if keyed:
        ts = np.concatenate([b.ts for b in keyed])
        tie = np.concatenate([b.tie for b in keyed])
        which = np.concatenate([np.full(len(b.ts), k, np.int32) for k, b in enumerate(keyed)])
        index = np.concatenate([np.arange(len(b.ts), dtype=np.int64) for b in keyed])
        order = np.lexsort((tie, ts))
        del ts, tie
        for c in range(0, len(order), CHUNK):
            sel = order[c:c + CHUNK]
            w, ix = which[sel], index[sel]
            text = np.empty(len(sel), dtype=object)
            for k in np.unique(w).tolist():
                mask = w == k
                text[mask] = np.array(keyed[k].lines(ix[mask]), dtype=object)
            out.write(("" if first else ",\n") + ",\n".join(text.tolist()))
            first = False
    out.write('\n],"displayTimeUnit":"ms","otherData":' + json.dumps(other, separators=(",", ":")) + "}\n")


def _us(t_ns: np.ndarray, t0_ns: int, shift_us: float) -> np.ndarray:
    us = np.round((np.asarray(t_ns, dtype=np.int64) - t0_ns) / 1000.0, 3)
    return np.round(us + shift_us, 3) if shift_us else us


_MILLI = [f"{i:03d}" for i in range(1000)]


def us_text(us: np.ndarray) -> list[str]:
    """Microseconds (rounded to 1 ns) as JSON numbers with three decimals, by integer arithmetic and
    a table: formatting each float was most of the cost of the slices' and counters' text
    (docs/benchmarks.md, "Reading: the events inflated into their array")."""
    n = np.rint(np.asarray(us, dtype=np.float64) * 1000.0).astype(np.int64)
    q, r = np.divmod(np.abs(n), 1000)
    out = [f"{a}.{_MILLI[b]}" for a, b in zip(q.tolist(), r.tolist(), strict=True)]
    for i in np.flatnonzero(n < 0).tolist():
        out[i] = "-" + out[i]
    return out


def _at(t_ns: int, win: Window, shift_us: float) -> float:
    """One event time in the trace's microseconds (never before its start)."""
    return round(max(float(_us(np.asarray([t_ns]), win.t0_ns, 0.0)[0]), 0.0) + shift_us, 3)


def _json_objects(objs: list[dict[str, Any]]) -> Block:
    """A few events (markers) written as their dicts, at their own "ts"."""
    texts = [json.dumps(o, separators=(",", ":")) for o in objs]
    return Block(np.asarray([o["ts"] for o in objs], dtype=np.float64), np.zeros(len(texts)),
                 lambda ix: [texts[i] for i in ix.tolist()])


# ---------------------------------------------------------------------------------------- slices
def scope_category(name: str) -> str:
    if name.startswith("## Call CompiledFxGraph"):
        return "compiled_graph"
    if name.startswith(("triton_", "cpp_fused", "cuda_fused")):
        return "kernel"
    if name.startswith("autograd::engine"):
        return "backward"
    if name.startswith("aten::"):
        return "op"
    return "scope"


def slice_block(cap: Capture, table: SliceTable, pid: int, win: Window, shift_us: float, which: str) -> Block:
    """Every scope as a complete ("X") event on its thread, with the FX nodes of kernels; `which`:
    "all", "graphs" (compiled-graph calls and their kernels, no eager op) or "none"."""
    if which == "none" or not len(table):
        return Block(np.zeros(0), np.zeros(0), lambda ix: [])
    names = [cap.scope_name(int(s)) for s in range(int(table.scope.max()) + 1)]
    cats = [scope_category(n) for n in names]
    head = [f'"name":{json.dumps(n)},"cat":"{c}"' for n, c in zip(names, cats, strict=True)]
    nodes = kernel_nodes(cap, table)
    keep = (table.end_row >= win.lo_row) & (table.begin_row <= win.hi_row)
    if which == "graphs":
        graphish = np.asarray([c in ("compiled_graph", "kernel") for c in cats])[table.scope]
        inside = np.zeros(len(table), bool)
        inside[list(nodes)] = True
        keep &= graphish | inside
    sel = np.flatnonzero(keep)
    ts = _us(table.t_begin_ns[sel], win.t0_ns, shift_us)
    dur = np.round((table.t_end_ns[sel] - table.t_begin_ns[sel]) / 1000.0, 3)
    extra: dict[int, str] = {}
    for i in np.flatnonzero(~table.closed).tolist() + list(nodes):
        args: dict[str, Any] = {} if table.closed[i] else {"closed": False}
        if i in nodes:
            args["graph"], args["fx_nodes"] = nodes[i]
        extra[i] = ',"args":' + json.dumps(args, separators=(",", ":"))

    # one prefix per (thread, scope) met: the slice's text is that, its times and its args
    threads = table.thread[sel]
    key = threads * (len(head) + 1) + table.scope[sel]
    uniq, inverse = np.unique(key, return_inverse=True)
    prefix = [f'{{"ph":"X","pid":{pid},"tid":{k // (len(head) + 1)},{head[k % (len(head) + 1)]},"ts":'
              for k in uniq.tolist()]

    def lines(ix: np.ndarray) -> list[str]:
        rows = sel[ix]
        return [f'{prefix[p]}{a},"dur":{d}{extra.get(r, "")}}}'
                for r, p, a, d in zip(rows.tolist(), inverse[ix].tolist(), us_text(ts[ix]), us_text(dur[ix]),
                                      strict=True)]

    return Block(ts, -dur, lines)


def kernel_nodes(cap: Capture, table: SliceTable) -> dict[int, tuple[str, str]]:
    """Slice -> (graph, FX nodes) for the kernel and extern-op slices directly inside a compiled
    graph's call: the k-th slice of a name in a call is the k-th call of that name in the graph's
    wrapper code, and its nodes are those of the buffers that call writes."""
    if not cap.graphs or not len(table):
        return {}
    graphs = {g.scope_name: g for g in cap.graphs}
    names = cap.strings
    ids = {i: graphs[n] for i, n in enumerate(names) if n in graphs}
    order = np.argsort(table.begin_row, kind="stable")
    begins = table.begin_row[order]
    out: dict[int, tuple[str, str]] = {}
    written: dict[int, dict[int, list[str]]] = {}  # graph -> call index -> buffers it writes first
    found_in: dict[tuple[int, bytes], list[tuple[int, tuple[str, str]]]] = {}
    for c in np.flatnonzero(np.isin(table.scope, list(ids))).tolist():
        graph = ids[int(table.scope[c])]
        if id(graph) not in written:
            by_call: dict[int, list[str]] = {}
            for buf, w in graph.wrapper.writer.items():
                by_call.setdefault(w, []).append(buf)
            written[id(graph)] = by_call
        lo, hi = np.searchsorted(begins, [table.begin_row[c] + 1, table.end_row[c]])
        inner = order[lo:hi]
        inner = inner[(table.thread[inner] == table.thread[c]) & (table.depth[inner] == table.depth[c] + 1)]
        scopes = table.scope[inner]
        key = (id(graph), scopes.tobytes())  # every call of a graph that runs the same kernels: one walk
        if key not in found_in:
            found_in[key] = _call_nodes(graph, scopes.tolist(), names, written[id(graph)])
        for j, label in found_in[key]:
            out[int(inner[j])] = label
    return out


def _call_nodes(graph: CompiledGraph, scopes: list[int], names: Sequence[str], written: dict[int, list[str]],
                ) -> list[tuple[int, tuple[str, str]]]:
    """(position among the call's slices, (graph, FX nodes)) of the slices whose wrapper call writes
    buffers with known FX nodes."""
    calls = graph.wrapper.calls_by_scope
    seen: dict[int, int] = {}
    out = []
    for j, scope in enumerate(scopes):
        k = seen.get(scope, 0)
        seen[scope] = k + 1
        at = calls.get(names[scope], ()) if 0 <= scope < len(names) else ()
        if k >= len(at):
            continue
        call = graph.wrapper.calls[at[k]]
        bufs = [call.out] if call.out else written.get(call.index, [])
        found = [n for b in bufs for n in graph.origins.get(b, [])]
        if found:
            out.append((j, (f"{graph.role} {graph.key}", ", ".join(dict.fromkeys(found)))))
    return out


# -------------------------------------------------------------------------------------- counters
def _span(rows: np.ndarray, win: Window) -> tuple[int, int]:
    """The positions of a series (its event `rows`) inside the window."""
    return int(np.searchsorted(rows, win.lo_row, side="left")), int(np.searchsorted(rows, win.hi_row, side="right"))


def _window_points(rows: np.ndarray, values: np.ndarray, win: Window, max_points: int) -> tuple[np.ndarray, int]:
    """Indices of the points kept in the window (downsampled: each bucket's lowest and highest), and
    the index of the point before the window (-1: none; its value opens the window)."""
    lo, hi = _span(rows, win)
    return lo + downsample(values[lo:hi], max_points), lo - 1


def counter_blocks(cap: Capture, dev: str, pid: int, win: Window, shift_us: float, max_points: int) -> list[Block]:
    """Allocated bytes, bytes by category and reserved bytes on one device, each opened by its value
    where the trace begins."""
    tl = cap.timeline(dev)
    t_open = _at(win.lo_ns, win, shift_us)
    keep, before = _window_points(tl.rows, tl.allocated, win, max_points)
    blocks = [_counter_block(pid, "allocated", ["bytes"], t_open, tl.allocated_at_pos(before),
                             _us(tl.t_at(keep), win.t0_ns, shift_us), tl.allocated[keep][:, None])]
    labels = cap.labels(dev)
    series = category_series(tl, labels, keep)
    opening = category_series(tl, labels, np.asarray([before]))[0] if before >= 0 else category_start(tl, labels)
    present = [c for c in range(len(CATEGORIES)) if series[:, c].any() or opening[c] or c == Category.UNATTRIBUTED]
    blocks.append(_counter_block(pid, "by category", [CATEGORIES[c] for c in present], t_open, opening[present],
                                 _us(tl.t_at(keep), win.t0_ns, shift_us), series[:, present]))
    if tl.has_reserved:
        rkeep, rbefore = _window_points(tl.reserved_rows, tl.reserved, win, max_points)
        ropen = tl.reserved_baseline if rbefore < 0 else int(tl.reserved[rbefore])
        blocks.append(_counter_block(pid, "reserved", ["bytes"], t_open, ropen,
                                     _us(tl.reserved_t_ns[rkeep], win.t0_ns, shift_us), tl.reserved[rkeep][:, None]))
    return blocks


def _counter_block(pid: int, name: str, keys: list[str], t_open: float, opening: Any, ts: np.ndarray,
                   values: np.ndarray) -> Block:
    template = (f'{{{{"ph":"C","pid":{pid},"name":{json.dumps(name)},"ts":{{}},"args":{{{{'
                + ",".join(f'{json.dumps(k)}:{{}}' for k in keys) + "}}}}")
    opening_values = np.atleast_1d(np.asarray(opening, dtype=np.int64)).tolist()
    ts_all = np.concatenate([[t_open], np.maximum(ts, 0.0) + 0.0])
    rows = values.tolist()

    def lines(ix: np.ndarray) -> list[str]:
        return [template.format(t, *(opening_values if i == 0 else rows[i - 1]))
                for i, t in zip(ix.tolist(), us_text(ts_all[ix]), strict=True)]

    return Block(ts_all, np.zeros(len(ts_all)), lines)


# ----------------------------------------------------------------------------------------- marks
def mark_block(cap: Capture, dev: str, pid: int, win: Window, shift_us: float) -> Block:
    """The peak (of the window, where the trace holds some steps) and the step markers."""
    raw, tl = cap.raw, cap.timeline(dev)
    objs: list[dict[str, Any]] = []
    lo, hi = _span(tl.rows, win)
    pos = tl.peak_pos if win.steps is None else (lo + int(np.argmax(tl.allocated[lo:hi])) if hi > lo else -1)
    if pos >= 0:
        row, value = int(tl.rows[pos]), int(tl.allocated[pos])
        what = "peak" if win.steps is None else f"steps {win.steps[0]}:{win.steps[1]} peak"
        bound = "" if cap.exact else " (lower bound)"
        stack = cap.scope_stack_at_peak(dev) if pos == tl.peak_pos else [
            cap.scope_name(s) for s in cap.scopes.stack_at(row, cap.info.main_thread)]
        objs.append({"ph": "i", "s": "p", "pid": pid, "tid": 0, "name": f"{what} {fmt_bytes(value)}{bound}",
                     "cat": "peak", "ts": _at(int(tl.t_at(pos)), win, shift_us),
                     "args": {"bytes": value, "scope": cap.scope_name(int(raw["scope"][row])),
                              "stack": " > ".join(stack)}})
    for r in np.flatnonzero(raw["kind"] == Kind.STEP).tolist():
        if win.lo_row <= r <= win.hi_row:  # (the marker before the first step is its start, not a step)
            objs.append({"ph": "i", "s": "p", "pid": pid, "tid": 0, "name": f"step {int(raw['bytes'][r])}",
                         "cat": "step", "ts": _at(int(raw["t_ns"][r]), win, shift_us),
                         "args": {"allocated": tl.allocated_before_row(r + 1)}})
    return _json_objects(objs)


def oom_block(cap: Capture, pid_of: Callable[[str], int], win: Window, shift_us: float) -> Block:
    raw = cap.raw
    objs: list[dict[str, Any]] = []
    for r in np.flatnonzero(raw["kind"] == Kind.OOM).tolist():
        if not win.lo_row <= r <= win.hi_row:
            continue
        dev = device_name(int(raw["device_type"][r]), int(raw["device_index"][r]))
        objs.append({"ph": "i", "s": "p", "pid": pid_of(dev), "tid": 0, "name": "OUT OF MEMORY", "cat": "oom",
                     "ts": _at(int(raw["t_ns"][r]), win, shift_us), "args": {"requested": int(raw["bytes"][r])}})
    return _json_objects(objs)
