"""The search of `memprof fit`: every configuration's compile-time prediction (`memprof sweep
--predict`'s, into the fit's directory), or an earlier fit's taken again (`--predictions`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from memprof.errors import MemprofError
from memprof.fit.plan import Candidate, Config
from memprof.fit.scale import scale_dir, with_value

if TYPE_CHECKING:
    from memprof.sweep.result import Sweep


def default_jobs(configurations: int) -> int:
    """Predicting processes at once: with a GPU, a process per configuration up to the cores (the
    processes take the device in turns for their forwards and share the cores for their compiles;
    more processes of fewer budgets each ended sooner: docs/benchmarks.md, "`--predict` under 3
    minutes" and session 8's fit time); on the CPU, where every forward runs on the cores with
    torch's own thread count, the cores up to 4."""
    from memprof.sweep.runner import visible_gpus

    cores = os.cpu_count() or 1
    return max(1, min(cores, configurations) if visible_gpus() else min(4, cores))


def _candidates(sweep: Sweep) -> list[Candidate]:
    from memprof.sweep.result import run_value

    out = []
    for run in sweep.runs:
        m = run.measured
        facts = m.facts if m is not None else None
        out.append(Candidate(Config(run.budget, None if run.variant == "stock" else run.variant),
                             run_value(run, "predict") if run.ok else None, m.resident if m is not None else None,
                             facts.recomputed_bytes if facts is not None else None,
                             not (facts is not None and facts.recomputed_random),
                             None if run.ok else (run.error or run.status), m.reserved if m is not None else None))
    return out


class Search(NamedTuple):
    """What the predictions of every configuration found."""

    candidates: list[Candidate]
    device: str  # where they ran
    parameter_bytes: int | None  # the model's parameters there
    compiled: bool  # the script compiled a graph with a backward (else no configuration applies to it)
    error: str | None  # why the script ended before that, where it ended badly in every prediction


def predicted(script: str, args: Sequence[str], budgets: Sequence[float], modes: Sequence[str], out: Path,
               jobs: int, timeout: float | None, progress: Callable[[object], None] | None,
               reuse: Path | None = None) -> Search:
    """Every configuration predicted into `out` (its predictions kept as search.json), or taken from
    `reuse`, an earlier fit's search.json of the same command, where it holds them all."""
    from memprof.sweep.manifest import record_files
    from memprof.sweep.runner import run_sweep

    record_files(out, "search.json")
    search = reused(reuse, script, args, budgets, ["stock", *modes], strict=False) if reuse is not None else None
    if search is not None:
        search.save(out)
    else:
        search = run_sweep(script, args, budgets, ["stock", *modes], out, jobs=jobs, timeout=timeout,
                           progress=progress, predict=True)  # (modes: the remat modes beside stock; [] stock only)
    (out / "sweep.json").replace(out / "search.json")
    device = next((r.measured.device for r in search.runs if r.measured is not None), "cpu")
    parameters = next((r.measured.parameter_bytes for r in search.runs if r.measured is not None
                       and r.measured.parameter_bytes is not None), None)
    compiled = any(r.measured is not None and r.measured.compiled for r in search.runs)
    error = None if compiled or any(r.ok for r in search.runs) else next(
        (f"the script ended before any compiled graph's backward ({r.status}): {r.error}" for r in search.runs), None)
    return Search(_candidates(search), device, parameters, compiled, error)


def check_predictions(path: Path, script: str, args: Sequence[str], budgets: Sequence[float], modes: Sequence[str],
                      template: str | None = None, values: Sequence[int] = ()) -> None:
    """Refuse, before anything is written, predictions `fit` could not take (`reused`); under
    `--scale`, those of another command at any value the earlier fit predicted (and there must be
    one): a value whose predictions lack a configuration is predicted anew."""
    variants = ["stock", *modes]
    if template is None:
        reused(path, script, args, budgets, variants)
        return
    found = [v for v in values if scale_dir(path, v).is_dir()]
    if not found:
        raise MemprofError(f"--predictions {path}: no scale-N directory of an earlier `fit --scale` over these values")
    for v in found:
        reused(scale_dir(path, v), script, with_value(args, template, v), (), ())


def reused(path: Path, script: str, args: Sequence[str], budgets: Sequence[float], variants: Sequence[str],
           strict: bool = True) -> Sweep | None:
    """The predictions an earlier fit made (its directory, or its search.json; under `--scale`, the
    directory of one value), for trying another limit without compiling again: only for the same
    command, and only where they hold every configuration asked for (else None, or with `strict`,
    refused)."""
    import shlex

    from memprof.sweep.result import load_sweep

    file = path / "search.json" if path.is_dir() else path
    if not file.is_file():
        raise MemprofError(f"--predictions {path}: no search.json there (give an earlier fit's directory)")
    sweep = load_sweep(file)
    if sweep.mode != "predict":
        raise MemprofError(f"--predictions {file}: measured runs, not a fit's predictions")
    asked = [script, *args]
    same = (len(sweep.command) == len(asked) and sweep.command[1:] == asked[1:]
            and os.path.realpath(sweep.command[0]) == os.path.realpath(script))
    if not same:
        raise MemprofError(f"--predictions {file}: made for `{shlex.join(sweep.command)}`, not `{shlex.join(asked)}`")
    runs = {(r.budget, r.variant): r for r in sweep.runs}
    missing = [f"{v} at {b:g}" for v in variants for b in budgets if (b, v) not in runs]
    if missing and not strict:
        return None
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise MemprofError(f"--predictions {file}: no prediction for {', '.join(missing[:3])}{more} "
                           "(search its budgets and modes, or predict again)")
    sweep.budgets, sweep.variants = list(budgets), list(variants)
    wanted = {(b, v) for v in variants for b in budgets}
    sweep.runs = [r for key, r in runs.items() if key in wanted]  # (in the order they were made)
    return sweep
