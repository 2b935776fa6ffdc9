"""`memprof fit`: the configuration that fits a training step under a memory limit, found by
compile-time prediction and proved by a run.

Every configuration memprof can set (stock budgets, and its remat pass at each) is predicted as
`memprof sweep --predict` does (no training step: the script stops at its first backward; budgets
share a process's script start, Dynamo trace and joint graph); the one predicted to fit with the
least recomputation runs for real (`memprof sweep`'s measured run: a capture), and stands only if
its run stayed under the limit (reserved bytes on CUDA, allocated on the CPU); else the next one
runs. When none fits, the smallest one runs, and its capture says what would close the gap.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from memprof.analysis.garbage import garbage_at
from memprof.analysis.held_outputs import held_output_bytes
from memprof.analysis.labels import CATEGORIES
from memprof.analysis.zero_grads import zero_grad_bytes
from memprof.errors import MemprofError
from memprof.event_checks import meminfo
from memprof.fit.plan import (
    Candidate,
    Config,
    FitResult,
    Measured,
    fitting,
    next_to_verify,
    reserved_overhead,
    smallest,
    suggestions,
)
from memprof.fit.scale import Probe, ScaleResult, answer, bisect, bisect_probes, probe, scale_dir, with_value
from memprof.fit.search import Search, check_predictions, default_jobs, predicted
from memprof.sweep.runner import visible_gpus

__all__ = ["Candidate", "Config", "FitResult", "Measured", "ScaleResult", "Search", "check_predictions",
           "default_jobs", "device_limit", "device_total", "fit", "fit_scale", "plan"]

DEFAULT_BUDGETS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)

BATCH_SCALED = ("saved_activation", "recomputed", "temporary", "input", "rng_mask", "workspace")
MAX_VERIFY = 3  # runs at most, when the preferred configurations' runs exceed the limit


def device_limit() -> int:
    """The memory a job can have: on a GPU its free memory as a process of the job sees it (its
    total less what is outside PyTorch: other processes, the process's own CUDA context), else the
    machine's available memory."""
    if visible_gpus():
        memory = gpu_memory()
        if memory is None:
            raise OSError("the GPU's free memory could not be read: give --memory as a size")
        return memory[0]
    available = meminfo("MemAvailable")
    if not available:
        raise OSError("no /proc/meminfo MemAvailable line: give --memory as a size")
    return available


def device_total() -> tuple[str, int] | None:
    """What a limit is checked against, and its total memory in bytes: the first GPU the job can
    see, else the machine's memory. None where it cannot be told."""
    if visible_gpus():
        memory = gpu_memory()
        return ("the GPU", memory[1]) if memory else None
    total = meminfo("MemTotal")
    return ("the machine", total) if total else None


# Asked of a child process, as a run of the job would see the device: a CUDA context made here
# would hold device memory for as long as `fit` runs, beside the runs it plans for.
_GPU_MEMORY = "import torch; print(*torch.cuda.mem_get_info())"


@functools.cache
def gpu_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the first GPU a child process sees (any GPU torch drives: CUDA, ROCm,
    WSL2), or None where the child could not tell."""
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_MEMORY], capture_output=True, text=True, timeout=120)
        free, total = (int(x) for x in out.stdout.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return free, total


def _verify(script: str, args: Sequence[str], config: Config, out: Path, n: int, timeout: float | None,
            progress: Callable[[object], None] | None) -> Measured | str:
    """One real run of `config` (a measured sweep of one budget, kept as verify-N.json): its figures,
    or why it has none."""
    from memprof.capture import load
    from memprof.sweep.manifest import record_files
    from memprof.sweep.runner import run_sweep

    variant = config.remat or "stock"
    sweep = run_sweep(script, args, [config.budget], [variant], out, timeout=timeout, progress=progress)
    record_files(out, f"verify-{n}.json")
    (out / "sweep.json").replace(out / f"verify-{n}.json")
    run = sweep.runs[0]
    if run.measured is None or run.capture is None:
        return f"{config.label}: {run.error or run.status}"
    cap = load(out / run.capture)
    dev = run.measured.device
    tl = cap.timeline(dev)
    m = run.measured
    return Measured(config, cap.peak(dev, lower_bound=True), tl.reserved_peak if tl.has_reserved else None,
                    m.step_peak, m.resident, m.step_ms, run.capture, cap.exact,
                    None if run.ok else (run.error or run.status), garbage_at(tl, tl.peak_pos, cap.gc_freed(dev)))


def _gap_suggestions(result: FitResult, out: Path, measured: Measured) -> None:
    from memprof.capture import load

    cap = load(out / measured.capture)
    dev = cap.main_device
    over = max(measured.peak, measured.reserved_peak or 0) - result.limit
    at_peak = {r.key: int(r.bytes) for r in cap.attribution("peak", "category", dev, lower_bound=True)}
    labels = cap.labels(dev)
    tl = cap.timeline(dev)
    largest = []  # the largest live allocation that grows with the batch (not a parameter or state)
    for a in cap.live_at(dev, top=50):
        pos = int(tl.pos_before_row(a.row)) + 1
        if CATEGORIES[int(labels.category[pos])] in BATCH_SCALED:
            largest.append((labels.names[int(labels.node[pos])] or a.scope, a.bytes))
            break
    slack = 0
    if tl.has_reserved and len(tl.reserved):
        k = int(tl.reserved.argmax())
        slack = int(tl.reserved[k]) - tl.allocated_before_row(int(tl.reserved_rows[k]) + 1)
    live = tl.live_positions(tl.peak_pos) if tl.peak_pos >= 0 else np.zeros(0, np.int64)
    held = held_output_bytes(labels, tl, live, int(tl.rows[tl.peak_pos])) if tl.peak_pos >= 0 else (0, [])
    result.suggestions = suggestions(over, at_peak, largest, slack, zero_grad_bytes(labels, tl, live), held)


def fit(script: str, args: Sequence[str], limit: int, budgets: Sequence[float], modes: Sequence[str], out: Path,
        jobs: int = 1, timeout: float | None = None, progress: Callable[[object], None] | None = None,
        reuse: Path | None = None) -> FitResult:
    """Predict every configuration (or take an earlier fit's predictions, `reuse`), verify the
    preferred one that fits (up to MAX_VERIFY runs), or, when none is predicted to, run the smallest
    and say what would close the gap. `out` must be ready (`memprof.sweep.prepare_dir`)."""
    search = predicted(script, args, budgets, modes, out, jobs, timeout, progress, reuse)
    candidates = search.candidates
    result = FitResult(limit, search.device, candidates, command=[script, *args],
                       parameter_bytes=search.parameter_bytes, compiled=search.compiled)

    tried: set[Config] = set()

    def run(config: Config) -> bool:
        """Verify `config`; whether its run stayed under the limit (then it is the choice)."""
        tried.add(config)
        measured = _verify(script, args, config, out, len(result.verified) + len(result.failed) + 1, timeout,
                           progress)
        if isinstance(measured, str):
            result.failed.append(measured)
            return False
        result.verified.append(measured)
        if measured.within(limit):
            result.choice = measured
        return result.choice is not None

    if not search.compiled:  # nothing to set: the script's own run says whether it fits as it is
        if search.error:  # (it did not get that far: it failed)
            result.failed.append(search.error)
            return result
        if not run(Config(1.0)) and result.verified:
            _gap_suggestions(result, out, result.verified[0])
        return result
    for _ in range(MAX_VERIFY):
        cand = next_to_verify(candidates, limit, result.verified, tried)
        if cand is None:
            break
        if run(cand.config):
            return result
    best = smallest(candidates)
    # (predicted over, or the preferred ones' runs were: the smallest's own run decides)
    if best is not None and best.config not in tried and run(best.config):
        return result
    runs = [m for m in result.verified if m.config == (best.config if best else None)] or result.verified
    if runs:
        _gap_suggestions(result, out, min(runs, key=lambda m: m.peak))
    return result


def fit_scale(script: str, args: Sequence[str], template: str, values: Sequence[int], limit: int,
              budgets: Sequence[float], modes: Sequence[str], out: Path, jobs: int = 1, timeout: float | None = None,
              progress: Callable[[object], None] | None = None, reuse: Path | None = None) -> ScaleResult:
    """The largest value of `template` (an argument with `{}`) whose best configuration is predicted
    to fit, by bisection over `values` (`memprof.fit.scale`), then verified by a run; a run over the
    limit tries the next configuration with room for the overhead it measured, then the next value
    down (MAX_VERIFY runs at most). `reuse`: an earlier `fit --scale`'s directory, whose values'
    predictions are taken where it made them."""
    from memprof.sweep.manifest import prepare_dir

    searched: dict[int, tuple[Search, bool]] = {}  # value -> (its search, whether of every configuration)
    least: Config | None = None  # what the probes after the first predict (below)

    def search(value: int, every: bool = True) -> Search:
        if value not in searched or (every and not searched[value][1]):
            sub = scale_dir(out, value)
            prepare_dir(sub, True)
            earlier = scale_dir(reuse, value) if reuse is not None else None
            if every or least is None:
                grid, whole = (list(budgets), list(modes)), True
            else:  # (the first probe's smallest configuration, beside stock at its budget)
                grid, whole = ([least.budget], [least.remat] if least.remat else []), False
            searched[value] = (predicted(script, with_value(args, template, value), grid[0], grid[1], sub, jobs,
                                         timeout, progress, earlier if earlier and earlier.is_dir() else None),
                               whole)
        return searched[value][0]

    def predict(value: int) -> list[Candidate]:
        return search(value).candidates

    def narrowed(value: int) -> list[Candidate]:
        return search(value, every=False).candidates

    first = search(values[(len(values) - 1) // 2])  # (bisection's first probe)
    if not first.compiled:
        return _scale_as_is(script, args, template, values, limit, out, timeout, progress, first.error)
    # A probe asks whether anything fits at its value: after the first probe's search of every
    # configuration, the others predict its smallest configuration alone (with stock at that budget),
    # the needs of the configurations keeping their order as the value grows; the answer's value is
    # then searched whole, for the preferred configuration there.
    found = smallest(first.candidates)
    least = found.config if found is not None else None
    result = ScaleResult(template, list(values), limit, bisect(values, narrowed, limit))
    result.answer = answer(result.probes)
    if result.answer is not None and not searched[result.answer.value][1]:
        whole = probe(result.answer.value, predict(result.answer.value), limit)
        result.probes = [whole if p.value == whole.value else p for p in result.probes]
        result.answer = answer(result.probes)
    value = result.answer.value if result.answer is not None and result.answer.choice is not None else None
    tried: set[tuple[int, Config]] = set()
    runs = 0
    while value is not None and runs < MAX_VERIFY:
        cands = predict(value)
        cand = next_to_verify(cands, limit, [m for _v, m in result.over],
                              {c for v, c in tried if v == value})
        if cand is None:  # nothing left here with room for the measured overhead: the next value down
            value = max((v for v in values if v < value), default=None)
            if value is not None and all(p.value != value for p in result.probes):
                result.probes.append(probe(value, predict(value), limit))
            continue
        tried.add((value, cand.config))
        runs += 1
        measured = _verify(script, with_value(args, template, value), cand.config, scale_dir(out, value), runs,
                           timeout, progress)
        if isinstance(measured, str):
            result.failed.append(measured)
            continue
        result.answer, result.measured = Probe(value, cand, smallest(cands)), measured
        if measured.within(limit):
            _verify_up(result, script, args, out, timeout, progress)
            return result
        result.over.append((value, measured))
    return result


def _verify_up(result: ScaleResult, script: str, args: Sequence[str], out: Path, timeout: float | None,
               progress: Callable[[object], None] | None) -> None:
    """After the answer's run fits: the next value up, where its probe's smallest configuration fits
    in allocated bytes with the reserved overhead that run measured but not by the allocator
    model's reserved bytes (high by 10.8% on the GQA decoder: docs/fit.md), runs as well, and
    becomes the answer if its run stays under the limit (twice at most)."""
    for _ in range(2):
        assert result.answer is not None and result.measured is not None
        higher = [v for v in result.values if v > result.answer.value]
        up = next((p for p in result.probes if higher and p.value == higher[0]), None)
        cand = up.smallest if up is not None and up.choice is None else None  # (nothing predicted to fit there)
        if up is None or cand is None or (cand.peak or 0) + reserved_overhead([result.measured]) > result.limit:
            return
        measured = _verify(script, with_value(args, result.template, up.value), cand.config,
                           scale_dir(out, up.value), 1, timeout, progress)
        if isinstance(measured, str):
            result.failed.append(measured)
            return
        if not measured.within(result.limit):
            result.over.append((up.value, measured))
            return
        result.answer, result.measured = Probe(up.value, cand, cand), measured


def _scale_as_is(script: str, args: Sequence[str], template: str, values: Sequence[int], limit: int, out: Path,
                 timeout: float | None, progress: Callable[[object], None] | None, error: str | None) -> ScaleResult:
    """`fit --scale` of a script with nothing to set (no compiled graph with a backward): each value
    probed runs as it is, by bisection, and the largest value whose run stayed under the limit is the
    answer, proved by that run. A run that fails (out of memory, say) counts as over the limit."""
    from memprof.sweep.manifest import prepare_dir

    result = ScaleResult(template, list(values), limit, compiled=False)
    if error:  # (the script did not get that far in its prediction: it failed)
        result.failed.append(error)
        return result

    def run(value: int) -> Probe | None:
        sub = scale_dir(out, value)
        prepare_dir(sub, True)
        ran = _verify(script, with_value(args, template, value), Config(1.0), sub, 1, timeout, progress)
        if isinstance(ran, str):
            result.failed.append(f"{template.replace('{}', str(value))}: {ran}")
            return None
        as_is = Candidate(Config(1.0), ran.step_peak, ran.resident)
        return Probe(value, as_is if ran.within(limit) else None, as_is, ran)

    result.probes = bisect_probes(values, run)
    result.answer = answer(result.probes)
    result.measured = result.answer.ran if result.answer is not None else None
    return result


def plan(script: str, args: Sequence[str], limit: int, remat: str | None = None,
         budgets: Sequence[float] = DEFAULT_BUDGETS, asked: str = "--budget") -> Config:
    """The configuration `trace --budget SIZE` runs: the preferred one predicted to fit under `limit`
    (`remat`: search only that mode beside stock, else `light`), or the smallest when none is; said
    in one line (`asked`: how the user asked for the limit). The predictions go to a temporary directory."""
    import tempfile

    from memprof.analysis.units import fmt_bytes
    from memprof.console import say
    from memprof.sweep.manifest import prepare_dir

    with tempfile.TemporaryDirectory(prefix="memprof-plan-") as tmp:
        out = Path(tmp) / "plan"
        prepare_dir(out, False)
        say(f"memprof: {asked} {fmt_bytes(limit)}: predicting {len(budgets) * 2} configurations (no training step)")
        search = predicted(script, args, budgets, [remat or "light"], out, default_jobs(2 * len(budgets)), None,
                            None)
    if not search.compiled:
        raise MemprofError(f"{asked} {fmt_bytes(limit)}: " + (search.error or "the script compiles no graph with "
                           "a backward (torch.compile), so no budget or remat mode applies to it"))
    candidates = search.candidates
    chosen = next(iter(fitting(candidates, limit)), None)
    if chosen is not None and chosen.peak is not None:
        say(f"memprof: {asked} {fmt_bytes(limit)} ({limit:,} B): {chosen.config.label}, predicted peak "
            f"{fmt_bytes(chosen.peak)} ({chosen.peak:,} B)")
        return chosen.config
    best = smallest(candidates)
    if best is None or best.need is None:
        errors = "; ".join(sorted({c.error for c in candidates if c.error}))[:300]
        raise MemprofError(f"{asked} {fmt_bytes(limit)}: no configuration could be predicted "
                           f"({errors or 'every prediction ended without a figure'})")
    say(f"memprof: warning: {asked} {fmt_bytes(limit)}: nothing is predicted to fit; running the smallest, "
        f"{best.config.label}, predicted {fmt_bytes(best.need)} ({fmt_bytes(best.need - limit)} over; memprof fit "
        "says what would close the gap)")
    return best.config
