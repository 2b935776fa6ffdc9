"""`memprof fit`'s certificate: the limit, the choice and its proof (predicted against measured), or
why nothing fits and what would; as text and as JSON."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from memprof.analysis.units import fmt_bytes
from memprof.fit.plan import Candidate, FitResult, Measured, fitting, others, preference, reserved_overhead, smallest
from memprof.fit.scale import Probe, ScaleResult, scale_dir, with_value


def _share(n: int, limit: int) -> str:
    return f"{n / limit:.1%}" if limit else "-"


def _proof(limit: int, m: Measured, cand: Candidate | None) -> list[str]:
    what = "allocated" if m.exact else "allocated, a lower bound: the capture dropped events"
    lines = []
    if cand is not None and cand.peak is not None:
        err = (cand.peak - m.peak) / m.peak if m.peak else 0.0
        lines.append(f"  predicted peak {fmt_bytes(cand.peak)} ({cand.peak:,} B: resident "
                     f"{fmt_bytes(cand.resident or 0)} + step {fmt_bytes(cand.step_peak or 0)}); "
                     f"measured {fmt_bytes(m.peak)} ({m.peak:,} B {what}, prediction {err:+.2%})")
    if m.reserved_peak is not None:
        predicted = ""
        if cand is not None and cand.reserved is not None and m.reserved_peak:
            predicted = (f"; predicted {fmt_bytes(cand.reserved)} by the allocator's model "
                         f"({(cand.reserved - m.reserved_peak) / m.reserved_peak:+.2%})")
        lines.append(f"  reserved by the caching allocator at most {fmt_bytes(m.reserved_peak)} "
                     f"({m.reserved_peak:,} B){predicted}")
    top = max(m.peak, m.reserved_peak or 0)
    word = "margin" if top <= limit else "over the limit by"
    lines.append(f"  {word} {fmt_bytes(abs(limit - top))} ({_share(abs(limit - top), limit)} of the limit)")
    if m.garbage:
        under = top > limit and top - m.garbage <= limit
        lines.append(f"  {fmt_bytes(m.garbage)} ({m.garbage:,} B) live at the peak was garbage in reference cycles, "
                     "freed later by Python's garbage collector when a collection happened to run"
                     + (" (without it the run is under the limit)" if under else "")
                     + ": gc.collect() after the first step (the one that compiles) frees it at a fixed point"
                     + (f"; the prediction leaves it out: {cand.peak - (m.peak - m.garbage):+,} B from the rest"
                        if cand is not None and cand.peak is not None else ""))
    if m.error:
        lines.append(f"  the run did not end well: {m.error}")
    return lines


def _garbage_note(m: Measured) -> str:
    return f" ({fmt_bytes(m.garbage)} of it garbage the collector freed later)" if m.garbage else ""


def _skipped(r: FitResult) -> list[str]:
    """Why configurations preferred to the choice and predicted to fit were not run."""
    over = reserved_overhead(r.verified)
    ran = {m.config for m in r.verified}
    skipped = [c for c in fitting(r.candidates, r.limit) if c.config not in ran]
    chosen = r.candidate(r.choice.config) if r.choice is not None else None
    if chosen is not None:  # (those after the choice were not needed)
        skipped = [c for c in skipped if preference(c) < preference(chosen)]
    if not over or not skipped:
        return []
    return [f"  not run: {len(skipped)} preferred configuration(s) predicted under the limit in allocated bytes "
            f"but within {fmt_bytes(over)} of it, the most the caching allocator reserved above the allocated "
            "peak in the runs above (" + ", ".join(c.config.label for c in skipped[:3])
            + (", ..." if len(skipped) > 3 else "") + ")"]


def _others(r: FitResult) -> list[str]:
    figures = others(r)
    if not figures:
        return []
    return ["  beside it, " + "; ".join(f"{what}: {fmt_bytes(n)} ({n:,} B)" for what, n in figures)]


def _format_uncompiled(r: FitResult, head: list[str]) -> str:
    """A script that compiles no graph with a backward: memprof's configurations do not apply; its
    run as it is says whether it fits."""
    m = r.choice or (r.verified[0] if r.verified else None)
    why = "the script compiles no graph with a backward (torch.compile), so no budget or remat mode applies"
    if m is None:
        if r.failed and not r.verified:  # it failed before a backward: nothing was measured
            return "\n".join([f"NOT MEASURED: {r.failed[0]}", head[0]])
        return "\n".join([f"NOT MEASURED: {why}, and its run left no figures", *head[1:]])
    lines = [("FITS AS IT IS" if m.within(r.limit) else "DOES NOT FIT") + f": {why}; its run as it is:", head[0],
             f"  measured peak {fmt_bytes(m.peak)} ({m.peak:,} B allocated" + ("" if m.exact else ", a lower bound")
             + ")"]
    lines += _proof(r.limit, m, None)
    lines += _others(r)
    if r.suggestions:
        lines.append("  what would close the gap (from the run's capture):")
        lines += [f"    - {s.what} (about {fmt_bytes(s.saves)} less)" for s in r.suggestions]
    return "\n".join(lines)


def format_fit(r: FitResult) -> str:
    limit = f"{fmt_bytes(r.limit)} ({r.limit:,} B, {r.device})"
    predicted = [c for c in r.candidates if c.peak is not None]
    lines = [f"memprof fit: {shlex.join(r.command)} under {limit}",
             f"  {len(predicted)} of {len(r.candidates)} configurations predicted, "
             f"{len(r.verified)} run to verify"]
    lines += [f"  a verifying run left no figures: {why}" for why in r.failed]
    if not r.compiled:
        return _format_uncompiled(r, lines)
    failed = [c for c in r.candidates if c.error]
    if failed:
        lines.append(f"  {len(failed)} could not be predicted: "
                     + "; ".join(f"{c.config.label}: {c.error}" for c in failed[:3]))
    if r.choice is not None:
        m = r.choice
        cand = r.candidate(m.config)
        lines.insert(0, f"FITS: {m.config.label}")
        lines += _proof(r.limit, m, cand)
        if m.step_ms is not None:
            lines.append(f"  step time {m.step_ms:.1f} ms (median of the run's steps after the first; the only "
                         "configuration timed is this one)")
        lines.append("  random ops: " + ("saved, never redrawn in the backward" if cand is None or
                                         cand.random_ops_saved else "REDRAWN in the backward"))
        lines += _others(r)
        lines.append(f"  run it:  memprof trace {shlex.join([*m.config.trace_options(), *r.command])}")
        lines.append("  or in the script, before it compiles:")
        lines += [f"    {line}" for line in ["import torch, memprof" if m.config.remat else "import torch",
                                              *m.config.python_lines()]]
        for other in r.verified:
            if other is not m:
                high = max(other.peak, other.reserved_peak or 0)
                lines.append(f"  also run: {other.config.label}: {fmt_bytes(high)}, over the limit"
                             + _garbage_note(other))
        lines += _skipped(r)
        return "\n".join(lines)
    best = smallest(r.candidates)
    lines.insert(0, "DOES NOT FIT: no configuration memprof can set keeps the step under the limit")
    if best is not None and best.need is not None:
        what = "reserved" if best.need > (best.peak or 0) else "allocated"
        lines.append(f"  the smallest: {best.config.label}, predicted {fmt_bytes(best.need)} {what}, "
                     f"{fmt_bytes(best.need - r.limit)} over" if best.need > r.limit else
                     f"  the smallest: {best.config.label}, predicted {fmt_bytes(best.need)} {what}")
    for m in r.verified:
        lines.append(f"  run: {m.config.label}")
        lines += ["  " + x for x in _proof(r.limit, m, r.candidate(m.config))]
    lines += _others(r)
    if r.suggestions:
        lines.append("  what would close the gap (from the capture of the smallest configuration):")
        lines += [f"    - {s.what} (about {fmt_bytes(s.saves)} less)" for s in r.suggestions]
    return "\n".join(lines)


def fit_json(r: FitResult) -> dict[str, Any]:
    choice = r.choice
    cand = r.candidate(choice.config) if choice is not None else smallest(r.candidates)
    shown = choice or next((m for m in r.verified if cand is not None and m.config == cand.config), None)
    if not r.compiled:  # its run as it is: nothing to choose
        choice, shown = None, r.choice or (r.verified[0] if r.verified else None)
    return {
        "limit_bytes": r.limit, "device": r.device, "fits": r.fits, "compiled": r.compiled,
        "choice": choice.config.to_json() if choice is not None else None,
        "predicted_peak_bytes": cand.peak if cand is not None else None,
        "measured_peak_bytes": shown.peak if shown is not None else None,
        "measured_reserved_bytes": shown.reserved_peak if shown is not None else None,
        "step_ms": shown.step_ms if shown is not None else None,
        "command": (["memprof", "trace", *choice.config.trace_options(), *r.command] if choice is not None else None),
        "python": choice.config.python_lines() if choice is not None else None,
        "candidates": [{**c.config.to_json(), "predicted_peak_bytes": c.peak,
                        "predicted_reserved_bytes": c.reserved, "resident_bytes": c.resident,
                        "step_peak_bytes": c.step_peak,
                        "random_ops_saved": c.random_ops_saved, "error": c.error} for c in r.candidates],
        "verified": [{**m.config.to_json(), "peak_bytes": m.peak,
                      "reserved_peak_bytes": m.reserved_peak, "garbage_bytes": m.garbage, "step_ms": m.step_ms,
                      "capture": m.capture,
                      "within_limit": m.within(r.limit), "error": m.error} for m in r.verified],
        "suggestions": [{"what": s.what, "saves_bytes": s.saves} for s in r.suggestions],
        "parameter_bytes": r.parameter_bytes,
        "others": [{"what": what, "bytes": n} for what, n in others(r)],
        "failed_runs": r.failed,
    }


def format_scale(r: ScaleResult, command: list[str]) -> str:
    name = r.template.replace("{}", "N")
    head = (f"memprof fit --scale: the largest {name} under {fmt_bytes(r.limit)} ({r.limit:,} B) for "
            f"{shlex.join(command)}")
    if not r.compiled:
        return _format_as_is(r, command, name, head)
    lines = [head]
    for p in sorted(r.probes, key=lambda p: p.value):
        if p.choice is not None and p.choice.peak is not None:
            lines.append(f"  {p.value:>8}: fits at {p.choice.config.label}, predicted {fmt_bytes(p.choice.peak)}")
        elif p.smallest is not None and p.smallest.need is not None:
            lines.append(f"  {p.value:>8}: does not fit, the smallest {fmt_bytes(p.smallest.need)} "
                         f"({p.smallest.config.label}, {fmt_bytes(p.smallest.need - r.limit)} over)")
        else:
            lines.append(f"  {p.value:>8}: no prediction")
    if r.answer is None or r.answer.choice is None:
        lines.insert(0, f"DOES NOT FIT at any value of {name} probed (from {r.values[0]})")
        return "\n".join(lines)
    m, choice = r.measured, r.answer.choice
    value = r.answer.value
    if m is None:
        lines.insert(0, f"NOT VERIFIED: {name.replace('N', str(value))} is predicted to fit, but its run failed: "
                     + "; ".join(r.failed))
        return "\n".join(lines)
    lines.insert(0, ("FITS" if m.within(r.limit) else "OVER THE LIMIT WHEN RUN") +
                 f": {r.template.replace('{}', str(value))} at {choice.config.label}")
    for v, over in r.over:
        if over is not m:
            then = ("run as well: only the allocator model's reserved bytes had ruled it out" if v > value
                    else "the next configuration or value down ran")
            lines.append(f"  run at {v} ({over.config.label}): {fmt_bytes(max(over.peak, over.reserved_peak or 0))}, "
                         f"over the limit{_garbage_note(over)}: {then}")
    lines.append(f"  run at {value}:")
    lines += ["  " + x for x in _proof(r.limit, m, choice)]
    higher = [v for v in r.values if v > value]
    if higher:
        ran_over = any(v == higher[0] for v, _m in r.over)
        lines.append(f"  the next value, {higher[0]}, " + ("ran over the limit" if ran_over else
                     "was predicted over the limit" if any(p.value == higher[0] for p in r.probes)
                     else "lies above a value predicted over the limit"))
    argv = [*choice.config.trace_options(), *with_value(command, r.template, value)]
    lines.append(f"  run it:  memprof trace {shlex.join(argv)}")
    return "\n".join(lines)


def _format_as_is(r: ScaleResult, command: list[str], name: str, head: str) -> str:
    """A script with nothing to set: each value probed ran as it is."""
    if not r.probes:  # (it failed before its first backward, or at every value run)
        return "\n".join([f"NOT MEASURED: {'; '.join(r.failed)}", head])
    nothing = "the script compiles no graph with a backward (torch.compile): nothing to set, each value ran as it is"
    lines = [head, f"  ({nothing})"]
    for p in sorted(r.probes, key=lambda p: p.value):
        if p.ran is not None:
            used = max(p.ran.peak, p.ran.reserved_peak or 0)
            verdict = "fits" if p.ran.within(r.limit) else (
                f"{fmt_bytes(used - r.limit)} over" if used > r.limit else f"not within: {p.ran.error or 'inexact'}")
            lines.append(f"  {p.value:>8}: ran, {fmt_bytes(used)} ({verdict})")
    lines += [f"  run failed: {f}" for f in r.failed]
    if r.answer is None or r.measured is None:
        lines.insert(0, f"DOES NOT FIT AS IT IS at any value of {name} run (from {r.values[0]})")
        return "\n".join(lines)
    value = r.answer.value
    lines.insert(0, f"FITS AS IT IS: {r.template.replace('{}', str(value))}")
    higher = [v for v in r.values if v > value]
    if higher:
        lines.append(f"  the next value, {higher[0]}, " + ("ran over the limit" if any(
            p.value == higher[0] for p in r.probes) else "lies above a value that ran over the limit"))
    lines.append(f"  run it:  memprof trace {shlex.join(with_value(command, r.template, value))}")
    return "\n".join(lines)


def scale_json(r: ScaleResult) -> dict[str, Any]:
    a, m = r.answer, r.measured
    return {
        "limit_bytes": r.limit, "template": r.template, "values": r.values, "compiled": r.compiled,
        "fits": r.fits, "value": a.value if a is not None else None,
        "choice": a.choice.config.to_json() if a is not None and a.choice is not None and r.compiled else None,
        "predicted_peak_bytes": a.choice.peak if a is not None and a.choice is not None and r.compiled else None,
        "measured_peak_bytes": m.peak if m is not None else None,
        "measured_reserved_bytes": m.reserved_peak if m is not None else None,
        "probes": [_probe(p) for p in sorted(r.probes, key=lambda p: p.value)],
        "failed_runs": r.failed,
        "runs_over_limit": [{"value": v, **m.config.to_json(), "peak_bytes": m.peak,
                             "reserved_peak_bytes": m.reserved_peak} for v, m in r.over],
    }


def _probe(p: Probe) -> dict[str, Any]:
    if p.ran is not None:  # (run as it is: measured, nothing predicted)
        return {"value": p.value, "fits": p.choice is not None, "measured_peak_bytes": p.ran.peak,
                "measured_reserved_bytes": p.ran.reserved_peak,
                "capture": f"{scale_dir(Path(), p.value).name}/{p.ran.capture}"}  # (fit.json's folder)
    shown = p.choice or p.smallest
    return {"value": p.value, "fits": p.choice is not None,
            "predicted_peak_bytes": shown.peak if shown is not None else None,
            **(shown.config.to_json() if shown is not None else {"budget": None, "remat": None})}
