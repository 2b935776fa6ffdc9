"""The sweep's terminal table and findings as text (pure: returns strings)."""

from __future__ import annotations

import statistics

from memprof.analysis.units import MB, fmt_bytes, fmt_mb
from memprof.sweep.detect import worst_per_budget
from memprof.sweep.result import Run, Sweep, run_estimate


def _status(r: Run) -> str:
    return r.status.upper() if r.status != "exit" else f"EXIT {r.exit_code}"


def _cell_ms(r: Run | None) -> str:
    ms = None if r is None or not r.ok or r.measured is None else r.measured.step_ms
    return "-" if ms is None else f"{ms:.1f}"


def render_table(sweep: Sweep) -> str:
    """A markdown table: per budget, each variant's step peak (MB) and step time (ms), and flags."""
    runs = {(r.variant, r.budget): r for r in sweep.runs}
    flagged = {v: {f.low: f for f in worst_per_budget(sweep.flags(v))} for v in sweep.variants}
    random = {v: dict(sweep.random_recompute(v)) for v in sweep.variants}
    head = ["budget"]
    for v in sweep.variants:
        if sweep.mode == "measure":
            head += [f"{v} peak MB", f"{v} est MB", f"{v} step ms", f"{v} saved MB", f"{v} recomputed MB"]
            if sweep.nproc > 1:
                head += [f"{v} highest rank", f"{v} rank spread MB"]
        else:
            head += [f"{v} predicted MB", f"{v} Inductor est (outputs kept) MB", f"{v} compile s", f"{v} saved MB",
                     f"{v} recomputed MB"]
    head += ["flags"]
    rows = [head, ["---"] * len(head)]
    for b in sweep.budgets:
        row = [f"{b:g}"]
        notes: list[str] = []
        for v in sweep.variants:
            r = runs.get((v, b))
            f = r.facts if r is not None and r.ok else None
            if r is None:
                row += ["-"] * 3
            elif not r.ok:
                row += [_status(r), "-", "-"]
            elif sweep.mode == "measure":
                row += [fmt_mb(r.step_peak), fmt_mb(run_estimate(r, "memprof")), _cell_ms(r)]
            else:
                secs = r.measured.compile_s if r.measured else None
                row += [fmt_mb(run_estimate(r, "memprof")), fmt_mb(run_estimate(r, "inductor (outputs kept)")),
                        "-" if secs is None else f"{secs:.0f}"]
            row += ["-" if f is None else f"{f.saved_bytes / MB:.1f}",
                    "-" if f is None else f"{f.recomputed_bytes / MB:.1f}"]
            if sweep.mode == "measure" and sweep.nproc > 1:
                top, spread = (r.highest_rank, r.rank_spread) if r is not None else (None, None)
                row += ["-" if top is None else str(top), fmt_mb(spread)]
            tag = "" if len(sweep.variants) == 1 else f"{v}: "
            if b in flagged[v]:
                fl = flagged[v][b]
                notes.append(f"{tag}more than {fl.high:g} (+{fl.excess / MB:.1f} MB)")
            if b in random[v]:
                notes.append(f"{tag}redraws {random[v][b]} random ops")
            freed = r.measured.gc_freed if r is not None and r.measured is not None else 0
            if freed:
                notes.append(f"{tag}Python's cyclic GC freed {fmt_mb(freed)} MB in a step")
            est = run_estimate(r, "memprof") if r is not None and r.measured is not None else None
            if r is not None and r.measured and r.measured.unseen_calls and est and r.step_peak and \
                    abs(est - r.step_peak) > r.step_peak / 200:  # (the summary's words, shorter)
                notes.append(f"{tag}est: {r.measured.unseen_calls} graph calls allocated what their wrapper code "
                             "does not show")
            if r is not None and not r.ok and r.error:
                notes.append(f"{tag}{r.error[:80]}")
        row.append("; ".join(notes))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = []
    for k, cells in enumerate(rows):
        if k == 1:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        else:
            out.append("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")
    return "\n".join(out)


def _slack_lines(sweep: Sweep, variant: str) -> list[str]:
    """What the caching allocator's unsplit blocks add to the measured peaks (above the requests),
    and how memprof's estimate counts them: replayed through its model of the allocator from the
    state each measured step began in, or (a prediction, no step to take that state from) not."""
    runs = [r for r in sweep.runs_of(variant) if r.step_peak and r.measured is not None]
    slack = [r.measured.block_slack for r in runs if r.measured is not None]
    if not any(slack):
        return []
    held = (f"the caching allocator's blocks held {fmt_bytes(int(statistics.median(slack)))} (median; up to "
            f"{fmt_bytes(max(slack))}) more than the requests at the measured peaks (large blocks it did not split)")
    if all(r.measured is not None and r.measured.estimate_blocks for r in runs):
        return [f"{held}; memprof's estimate counts them, replaying the step's requests through a model of "
                "the allocator from its state when the step began"]
    errs = [abs(float(e) - (r.step_peak - r.measured.block_slack)) / (r.step_peak - r.measured.block_slack)
            for r in runs if r.measured is not None and r.step_peak and (e := run_estimate(r, "memprof")) is not None
            and r.step_peak > r.measured.block_slack]
    line = f"{held}; memprof's estimate counts requests here"
    if errs:
        line += (f"; against the requests (peak less those bytes) its median error is "
                 f"{statistics.median(errs):.1%}, max {max(errs):.1%}")
    return [line]


def render_findings(sweep: Sweep) -> str:
    """Flags with their diagnoses, random-op warnings and notes."""
    out: list[str] = []
    for v in sweep.variants:
        flags = sweep.flags(v)
        name = "stock" if v == "stock" else f"--remat {v}"
        if sweep.mode == "predict":
            name += " (predicted)"
        auto = " (2% of the smallest peak, at most 1.5 MB)" if sweep.noise.get("abs_bytes") is None else ""
        noise = f"noise: max({fmt_bytes(sweep.abs_tol())}{auto}, {sweep.rel_tol():.1%})"
        if not flags:
            ok = [r for r in sweep.runs_of(v) if sweep.value(r) is not None]
            if len(ok) >= 2 and sweep.floor_hides(v):
                out.append(f"{name}: the noise floor exceeds every difference between these {len(ok)} budgets' "
                           f"peaks, so nothing could be flagged ({noise}; lower it with --noise-mb/--noise-rel)")
            elif len(ok) >= 2:
                out.append(f"{name}: less budget never gives more memory here ({len(ok)} budgets; {noise})")
        else:
            diagnoses = sweep.diagnoses(v)
            which = "" if len(diagnoses) == len(flags) else "; for each lower budget, the pair it exceeds most"
            out.append(f"{name}: less budget, more memory at {len(flags)} pair(s) of budgets ({noise}){which}:")
            for d in diagnoses:
                out.append(f"  - {d.lines[0]}")
                out.extend(f"      {ln}" for ln in d.lines[1:])
        rnd = sweep.random_recompute(v)
        if rnd:
            out.append(f"{name}: the backward redraws random ops at budget(s) "
                       f"{', '.join(f'{b:g} ({n})' for b, n in rnd)}: fresh dropout masks, wrong gradients "
                       f"(pytorch#190758; `--remat light` saves the random seeds or masks instead)")
        scores = sweep.estimator_scores(v)
        for est, sc in scores.items():
            if not sc["budgets"] or all(sc[k] is None for k in ("spearman", "median_error", "max_error")):
                continue  # a line of n/a says nothing
            if est == "inductor (outputs kept)" and sweep.same_estimates(v, "inductor", est):
                continue  # the same figures as Inductor's line
            rho = "n/a" if sc["spearman"] is None else f"{sc['spearman']:.3f}"
            med = "n/a" if sc["median_error"] is None else f"{sc['median_error']:.1%}"
            top = "n/a" if sc["max_error"] is None else f"{sc['max_error']:.1%}"
            out.append(f"{name}: {est} estimate vs measured over {sc['budgets']} budgets: Spearman {rho}, "
                       f"median error {med}, max {top}")
            if est == "memprof":
                out.extend(f"  {line}" for line in _slack_lines(sweep, v))
    out.extend(f"note: {n}" for n in sweep.notes)
    return "\n".join(out)
