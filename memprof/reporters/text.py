"""The text and JSON summaries (`memprof report`, the `memprof trace` summary)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import IO, Any

from memprof.analysis.held_outputs import ADVICE as HELD
from memprof.analysis.oom import format_oom
from memprof.analysis.summary import DeviceSummary, Summary, rng_warnings, step_rows, summarize
from memprof.analysis.units import count, fmt_bytes, fmt_mb
from memprof.analysis.zero_grads import ADVICE
from memprof.capture import Capture
from memprof.errors import MemprofError, printable
from memprof.outputs import json_text
from memprof.reporters.ranks import write_ranks_json, write_ranks_text
from memprof.reporters.registry import Reporter, register


@dataclass(frozen=True)
class SummaryOptions:
    top: int = 8  # rows in each list of the summary


@dataclass(frozen=True)
class TableOptions:
    by: str = "category"  # category, node, layer, kernel, or step (a row per step)
    at: str = "peak"  # peak or step:N
    device: str | None = None  # None: the main device
    top: int | None = None  # rows shown (None: 20 in text, all in JSON)


def render_text(cap: Capture, top: int = 8) -> str:
    return printable(format_summary(summarize(cap, top)))


def _write_text(cap: Capture, o: SummaryOptions, out: IO[str]) -> None:
    out.write(render_text(cap, o.top) + "\n")


def _write_json(cap: Capture, o: SummaryOptions, out: IO[str]) -> None:
    out.write(json_text(summarize(cap, o.top).to_json(), indent=1) + "\n")


def _head(s: Summary) -> list[str]:
    head = f"memprof: {s.events:,} events over {s.duration_s:.2f} s"
    if s.command:
        head += f" · {s.command}"
    if s.options_after_script:  # the user may have meant them for the script
        head += f" · memprof took {' '.join(s.options_after_script)} from after the script (the script's own: after --)"
    if s.budget is not None:
        head += f" · activation_memory_budget={s.budget}"
    lines = [head, *(f"  {c}" for c in s.caveats)]
    if s.status not in (None, "completed", "exit"):
        lines.append(f"  the script ended early ({s.status}): {s.error or ''}".rstrip(": "))
    elif s.status == "exit" and s.exit_code not in (None, 0):
        lines.append(f"  the script called sys.exit({s.exit_code})")
    lines.append(f"  {'device':<8} {'peak':>12} {'exact bytes' if s.exact else 'at least bytes':>15} {'at':>9} "
                 f"{'reserved peak':>14} {'live at peak':>13}")
    bound = "" if s.exact else "≥ "
    for d in s.devices:
        lines.append(
            f"  {d.device:<8} {bound + fmt_bytes(d.peak_bytes):>12} {d.peak_bytes:>15,} "
            f"{d.peak_t_s:>8.3f}s {fmt_bytes(d.reserved_peak_bytes):>14} {d.live_at_peak:>13,}"
        )
    return lines


def _age(ms: float) -> str:
    """An age in the unit that reads: milliseconds under a second, then seconds, then minutes."""
    if ms < 1000:
        return f"{ms:.1f} ms"
    return f"{ms / 1000:.2f} s" if ms < 120_000 else f"{ms / 60_000:.1f} min"


def _at_peak(d: DeviceSummary, bound: str) -> list[str]:
    """Categories, graph-call joins, the largest allocations and scopes live at a device's peak."""
    lines: list[str] = []
    if d.categories_at_peak:
        lines.append(f"{d.device} peak {bound}{fmt_bytes(d.peak_bytes)} by category:")
        for c in d.categories_at_peak:
            lines.append(f"  {fmt_bytes(c.bytes):>10}  {c.share * 100:5.1f}%  {c.key} ({count(c.count, 'allocation')})")
    calls = d.graph_calls
    if calls.total:
        kernel_level = sum(calls.kernel_level.values())
        text = f"  compiled-graph calls: {calls.total}, joined to buffers and FX nodes: {calls.buffer_level}"
        if kernel_level:
            why = "; ".join(f"{n}x {r}" for r, n in calls.kernel_level.items())
            text += f"; attributed at kernel level only: {kernel_level} ({why})"
        lines.append(text)
    lines.append(f"{d.device} peak {bound}{fmt_bytes(d.peak_bytes)}: largest live allocations")
    for a in d.largest:
        req = f" (requested {a.requested:,} B)" if a.requested >= 0 and a.requested != a.bytes else ""
        what = f"{a.node} ({a.category})" if a.node else (a.scope or "(no scope)")
        lines.append(f"  {fmt_bytes(a.bytes):>10}  {what}{req}, allocated {_age(a.age_ms)} before the peak")
    if d.allocated_before_capture_bytes:
        lines.append(f"  {fmt_bytes(d.allocated_before_capture_bytes):>10}  allocated before the capture")
    if d.zero_grads_at_peak:
        lines.append(f"  {fmt_bytes(d.zero_grads_at_peak):>10}  of the peak are {ADVICE}")
    if d.held_outputs_at_peak:
        lines.append(f"  {fmt_bytes(d.held_outputs_at_peak):>10}  of the peak are "
                     + HELD.format(nodes=", ".join(d.held_output_nodes)))
    if d.scopes:
        lines.append("  live bytes at the peak by the scope open when each was allocated (the innermost op or "
                     "kernel; --by kernel names compiled-graph buffers by the kernel that wrote them):")
        lines.extend(f"  {fmt_bytes(sc.bytes):>10}  {sc.scope} ({count(sc.count, 'allocation')})" for sc in d.scopes)
    if d.stack_at_peak:
        lines.append("  running at the peak: " + " > ".join(d.stack_at_peak))
    return lines


def _steps(d: DeviceSummary) -> list[str]:
    """Per-step peaks, what the garbage collector freed, and inferred sizes."""
    lines: list[str] = []
    complete = [st for st in d.steps if st.complete]
    if complete:
        peaks = [st.peak_bytes for st in complete]
        lines.append(f"  {len(complete)} steps: peak per step {fmt_bytes(min(peaks))} .. {fmt_bytes(max(peaks))}"
                     f" (step {complete[peaks.index(max(peaks))].step} highest)")
    freed = d.gc_freed
    if freed.count:
        in_steps = [st for st in complete if st.gc_freed_bytes]
        where = f", in {len(in_steps)} of {len(complete)} steps" if complete else ""
        lines.append(f"  Python's cyclic garbage collector freed {freed.count:,} allocations "
                     f"({fmt_bytes(freed.bytes)}{where}): tensors held in reference cycles, freed when a "
                     "collection happens to run, so the peak can move with unrelated Python code; "
                     "gc.disable() during steps and gc.collect() between them makes it repeatable")
        lines.extend(f"  {fmt_bytes(sc.bytes):>10}  of them allocated in {sc.scope} ({count(sc.count, 'allocation')})"
                     for sc in freed.by_scope[:3])
    if d.inferred_sizes:
        lines.append(f"  note: {d.inferred_sizes} allocation sizes inferred from requested sizes "
                     "(seen only by the CUDA tracker)")
    return lines


def _tail(s: Summary) -> list[str]:
    """Compile plans, warnings, OOMs and notes."""
    lines: list[str] = [""] if s.plans else []
    for p in s.plans:
        lines.append(f"compile plan {p.index} ({p.backend}, budget {p.budget:g}): "
                     f"{p.saved} saved values ({fmt_bytes(p.saved_bytes)}"
                     + (f" + {p.saved_symbolic} of symbolic size" if p.saved_symbolic else "") + "), "
                     f"{p.recomputed} recomputed nodes, {p.random_ops} random ops, {len(p.masks)} dropout masks")
        if p.remat:
            lines.append(f"  {p.remat}")
    if s.graph_breaks:
        if not s.plans:
            lines.append("")
        lines.append(f"graph breaks: Dynamo compiled the code in parts, split at {count(len(s.graph_breaks), 'place')} "
                     "(a tensor one part returns and the next takes stays live across the split, outside what the "
                     "partitioner and the budget decide):")
        lines.extend(f"  {b}" for b in s.graph_breaks)
    measured = s.step.measured if s.step is not None else None
    if s.step is not None and measured is not None:
        st = s.step
        line = (f"step peak above resident bytes ({st.device}, median over the steps after the compiling one): "
                f"{fmt_mb(measured)} MB measured")
        if st.estimate is not None:
            diff = st.estimate - measured
            off = f" ({diff:+,} B, {diff / measured:+.2%})" if measured else ""
            line += f"; memprof's estimate from the compiled code {fmt_mb(st.estimate)} MB{off}"
            if st.requested is not None:
                line += (f" in the caching allocator's blocks, replayed from its state when the step began "
                         f"(the requests alone: {fmt_mb(st.requested)} MB)")
            if st.unprobed:
                line += f" without the scratch of {len(st.unprobed)} fallback call(s) it could not run here"
            if not st.phase and abs(diff) > measured // 200:
                # e.g. a foreach optimizer's temporaries: the estimate walks compiled graphs only
                line += "; the measured peak is outside the compiled graphs, which is all the estimate covers"
            unseen = sum(d.graph_calls.unseen for d in s.devices if d.device == st.device)
            if unseen and abs(diff) > measured // 200:
                line += (f"; {count(unseen, 'compiled-graph call')} made allocations the wrapper code does not "
                         "show (a kernel's or library's own buffers that memprof did not measure), which the "
                         "estimate cannot count")
        lines.append(line + " (memprof sweep's 'peak' and 'est')")
    lines.extend(f"WARNING: {w}" for w in s.warnings)
    for o in s.ooms:
        lines.extend(format_oom(o))
    if s.unfollowed_events:
        lines.append(f"note: {s.unfollowed_events:,} allocator events came from threads memprof does not "
                     "follow (seen by the CUDA tracker only)")
    lines.extend(f"note: {n}" for n in s.notes)
    return lines


def format_summary(s: Summary) -> str:
    lines = _head(s)
    bound = "" if s.exact else "≥ "
    for k, d in enumerate(s.devices):  # the device that peaked first; the others (a GPU job's CPU side) shorter
        if k and d.categories_at_peak:
            lines += ["", *_at_peak(d, bound)[:1 + len(d.categories_at_peak)]]
        elif not k and (d.largest or d.steps):
            lines += ["", *_at_peak(d, bound), *_steps(d)]
    return "\n".join(lines + _tail(s))


def _table(cap: Capture, by: str, at: str, device: str | None) -> tuple[list[Any], str, bool]:
    """Attribution rows at `at`, what `at` is and whether it is the exact point asked for: an
    incomplete capture has only a lower bound of its peak, and of the step it stopped in."""
    rows = cap.attribution(at=at, by=by, device=device, lower_bound=True)
    # a step that ended (its marker kept) is whole; the one the capture stopped in is not
    exact = cap.exact if at == "peak" else any(f"step:{s.step}" == at and s.complete for s in cap.steps(device))
    label = at if exact else f"{at} of the events kept (a lower bound)"
    return rows, label, exact


def _write_table(cap: Capture, o: TableOptions, out: IO[str]) -> None:
    if o.by == "step":
        out.write(render_steps(cap, _step_device(cap, o)) + "\n")
    else:
        out.write(render_table(cap, o.by, o.at, o.device, o.top or 20) + "\n")


def _step_device(cap: Capture, o: TableOptions) -> str:
    if o.at != "peak":
        raise MemprofError("--by step lists every step; --at does not apply to it")
    return o.device or cap.main_device


def render_steps(cap: Capture, device: str) -> str:
    """One row per step: when, how long, what was live at its start and end, its peak and how far
    it rose."""
    rows = step_rows(cap, device)
    if not rows:
        return f"{device}: no steps (a step ends at each optimizer step, or at memprof.step())"
    reserved = any(r.reserved_at_end is not None for r in rows)
    peaks = [r.peak_bytes for r in rows]
    highest = rows[peaks.index(max(peaks))].step
    lines = [f"{device}: {count(len(rows), 'step')}, bytes exact (a step ends at each optimizer step, or at "
             "memprof.step(); rise: its peak above what was live when it began)"]
    lines.extend(f"  {c}" for c in cap.caveats)
    lines.append(f"  {'step':>5} {'start s':>9} {'ms':>9} {'at start':>10} {'peak':>10} {'peak bytes':>15} "
                 f"{'rise':>10} {'at end':>10}" + (f" {'reserved':>10}" if reserved else "") + f" {'gc freed':>9}")
    for r in rows:
        line = (f"  {r.step:>5} {r.start_s:>9.3f} {r.duration_ms:>9.1f} {fmt_bytes(r.allocated_at_start):>10} "
                f"{fmt_bytes(r.peak_bytes):>10} {r.peak_bytes:>15,} {fmt_bytes(r.rise_bytes):>10} "
                f"{fmt_bytes(r.allocated_at_end):>10}")
        if reserved:
            line += f" {fmt_bytes(r.reserved_at_end) if r.reserved_at_end is not None else '-':>10}"
        line += f" {fmt_bytes(r.gc_freed_bytes) if r.gc_freed_bytes else '':>9}"
        if not r.complete:
            line += "  (the capture stopped in it)"
        elif r.step == highest:
            line += "  highest (the first of its peak)" if peaks.count(max(peaks)) > 1 else "  highest"
        lines.append(line)
    return printable("\n".join(lines))


def render_table(cap: Capture, by: str = "category", at: str = "peak", device: str | None = None,
                 top: int = 20) -> str:
    rows, label, _exact = _table(cap, by, at, device)
    total = sum(r.bytes for r in rows)
    dev = device or cap.main_device
    lines = [f"{dev} at {label}: {fmt_bytes(total)} live ({total:,} bytes) by {by}"]
    lines.extend(f"  {c}" for c in cap.caveats)
    width = min(60, max([len(r.key) for r in rows[:top]] + [len(by)]))  # longer keys are printed whole
    head = f"  {by:<{width}} {'bytes':>12} {'share':>7} {'count':>7}"
    if by != "category":
        head += "  largest category"
    lines.append(head)
    for r in rows[:top]:
        line = f"  {r.key:<{width}} {fmt_bytes(r.bytes):>12} {r.share * 100:6.1f}% {r.count:>7,}"
        if by != "category":
            line += f"  {r.category}"
        lines.append(line)
    if len(rows) > top:
        rest = rows[top:]
        lines.append(f"  {'(' + str(len(rest)) + ' more)':<{width}} {fmt_bytes(sum(r.bytes for r in rest)):>12} "
                     f"{sum(r.share for r in rest) * 100:6.1f}% {sum(r.count for r in rest):>7,}")
    if by == "layer":
        lines.extend(_layer_matrix(cap, at, dev, top))
    for w in rng_warnings(cap):
        lines.append(f"WARNING: {w}")
    return printable("\n".join(lines))


def _layer_matrix(cap: Capture, at: str, device: str, top: int) -> list[str]:
    """The same bytes by layer and category (each row sums to the layer's bytes above)."""
    from memprof.analysis.attribution import point_of
    from memprof.analysis.view import layer_category

    tl = cap.timeline(device)
    matrix = layer_category(tl, cap.labels(device), point_of(tl, at, [(s.step, s.peak_pos) for s in cap.steps(device)]))
    totals: dict[str, int] = {}
    for row in matrix.values():
        for c, b in row.items():
            totals[c] = totals.get(c, 0) + b
    cats = sorted(totals, key=lambda c: -totals[c])
    layers = sorted(matrix, key=lambda k: -sum(matrix[k].values()))[:top]
    width = min(40, max([len(k) for k in layers] + [5]))
    cw = max(10, *(len(c) for c in cats)) if cats else 10
    out = ["by layer and category:", f"  {'layer':<{width}} " + " ".join(f"{c:>{cw}}" for c in cats)]
    for k in layers:
        out.append(f"  {k[:width]:<{width}} " + " ".join(f"{fmt_bytes(matrix[k][c]) if matrix[k].get(c) else '':>{cw}}"
                                                      for c in cats))
    return out


def _write_table_json(cap: Capture, o: TableOptions, out: IO[str]) -> None:
    if o.by == "step":
        dev = _step_device(cap, o)
        out.write(json_text({"device": dev, "by": "step", "exact": cap.exact, "caveats": cap.caveats,
                             "rows": [{**asdict(r), "rise_bytes": r.rise_bytes} for r in step_rows(cap, dev)]},
                            indent=1) + "\n")
        return
    rows, _label, exact = _table(cap, o.by, o.at, o.device)
    by, at, device, top = o.by, o.at, o.device, o.top or 0
    out.write(json_text({
        "device": device or cap.main_device, "at": at, "by": by, "bytes": sum(r.bytes for r in rows),
        "exact": exact, "caveats": cap.caveats,
        "rows": [asdict(r) for r in (rows[:top] if top else rows)], "warnings": cap.caveats + rng_warnings(cap),
    }, indent=1) + "\n")


register(Reporter("text", "report", ".txt", "peak summary as text", SummaryOptions, _write_text, write_ranks_text))
register(Reporter("json", "report", ".json", "peak summary as JSON", SummaryOptions, _write_json, write_ranks_json))
register(Reporter("table", "report", ".txt", "attribution table (memprof report --by)", TableOptions, _write_table))
register(Reporter("table-json", "report", ".json", "attribution table as JSON", TableOptions, _write_table_json))
