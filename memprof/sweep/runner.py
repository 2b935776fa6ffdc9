"""Running a sweep: one `memprof trace` process per (variant, budget), `jobs` at a time; with
--predict, at most `jobs` processes, several budgets of a variant sharing one where there are more
budgets than jobs (`memprof.sweep.predict`), each `memprof _sweep-child`.

Each process writes its capture and a small JSON of what `memprof.sweep.measure` found (computed
in the child, from the capture still in memory). A process that fails is recorded with its status
and the sweep goes on; Ctrl-C stops the running processes (their partial captures are saved) and
writes what is done.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from memprof.analysis.units import count
from memprof.errors import MemprofError, one_line
from memprof.spill import spill_path
from memprof.sweep.manifest import record_files
from memprof.sweep.measure import ChildResult, Measured
from memprof.sweep.result import Run, Sweep, highest_rank
from memprof.sweep.spec import budget_label

Progress = Callable[[Run], None]


# The device files a GPU driver makes (NVIDIA's; WSL2's paravirtual GPU; ROCm's kernel driver):
# where there is none, no GPU can be visible, and torch (seconds to import on a busy machine, in a
# process that only starts others) need not be asked.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def visible_gpus() -> list[str]:
    """The GPUs child processes are spread over, round robin (CUDA_VISIBLE_DEVICES when set)."""
    if not any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # as CUDA reads it: the devices before the first empty or negative entry ("-1" hides all)
        gpus = []
        for v in (v.strip() for v in visible.split(",")):
            if not v or v.startswith("-"):
                break
            gpus.append(v)
        return gpus
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    except Exception:  # pragma: no cover - torch is a dependency
        return []


class _Pool:
    """The child processes, so that Ctrl-C can stop them all."""

    def __init__(self) -> None:
        self.procs: set[subprocess.Popen[bytes]] = set()
        self.lock = threading.Lock()
        self.stopping = False

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            procs = list(self.procs)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # memprof trace saves the partial capture on SIGTERM
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()


def _run_group(pool: _Pool, out: Path, script: str, args: Sequence[str], variant: str, budgets: Sequence[float],
               gpu: str | None, timeout: float | None, extra_env: dict[str, str], predict: bool = False,
               device_lock: Path | None = None, nproc: int = 1) -> list[Run]:
    """One process (`memprof _sweep-child`): one budget measured, or (`predict`) one or more budgets of
    a variant predicted; a Run per budget. With `nproc` > 1, one measured budget as a torchrun job of
    that many processes, each rank writing its own capture and JSON (`ranks.rank_path`)."""
    labels = [f"{variant}_{budget_label(b)}" for b in budgets]
    log_name = f"logs/{labels[0]}.log" if len(labels) == 1 else f"logs/{labels[0]}+{len(labels) - 1}.log"
    measure_paths = [out / "logs" / f"{label}.json" for label in labels]
    ranks = [f".rank{r}" for r in range(nproc)] if nproc > 1 else [""]
    captures = [] if predict else [f"{label}{r}.memprof{spill}" for label in labels for r in ranks
                                   for spill in ("", ".spill")]
    record_files(out, log_name, *(f"logs/{label}{r}.json" for label in labels for r in ranks), *captures,
                 *([str(device_lock.relative_to(out))] if device_lock is not None else []))
    cmd = [sys.executable, "-m", "memprof", "_sweep-child"]
    if nproc > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    for b, path in zip(budgets, measure_paths, strict=True):
        cmd += ["--budget", repr(b), "--json", str(path)]
    if predict:
        cmd.append("--predict")
        if device_lock is not None:
            cmd += ["--device-lock", str(device_lock)]
    else:
        if len(budgets) != 1:
            raise ValueError("a measured budget runs alone")
        cmd += ["-o", str(out / f"{labels[0]}.memprof")]
        if device_lock is not None:  # steps timed in turns (`sweep.turns`)
            cmd += ["--step-lock", str(device_lock)]
    if variant != "stock":
        cmd += ["--remat", variant]
    cmd += [script, "--", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    limit = None if timeout is None else timeout * len(budgets)
    t0 = time.monotonic()
    status = None
    with open(out / log_name, "wb") as log:
        with pool.lock:
            if pool.stopping:
                return [Run(variant, b, "interrupted", None, "not started (interrupted)", None, log_name, 0.0)
                        for b in budgets]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            pool.procs.add(proc)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = proc.returncode
            status = "timeout"
        finally:
            with pool.lock:
                pool.procs.discard(proc)
    wall = round(time.monotonic() - t0, 2)
    if nproc > 1:
        return [_collect_ranks(out, variant, budgets[0], labels[0], measure_paths[0], log_name, rc, status, timeout,
                               wall, nproc)]
    return [_collect(out, variant, b, label, path, log_name, rc, status, timeout, wall)
            for b, label, path in zip(budgets, labels, measure_paths, strict=True)]


def _collect_ranks(out: Path, variant: str, budget: float, label: str, measure_path: Path, log_name: str,
                   rc: int | None, status: str | None, timeout: float | None, wall: float, nproc: int) -> Run:
    """One budget's Run from a torchrun job's ranks: the highest rank's measurement and capture, every
    rank's step peak; where a rank did not complete, the one that failed first (its result written
    first: the others' errors are often the lost connection to it)."""
    from memprof.ranks import rank_path

    paths = [rank_path(measure_path, r) for r in range(nproc)]
    runs = [_collect(out, variant, budget, f"{label}.rank{r}", paths[r], log_name, rc, status, timeout, wall)
            for r in range(nproc)]
    peaks = [r.step_peak for r in runs]

    def written(r: int) -> int:
        return paths[r].stat().st_mtime_ns if paths[r].exists() else 1 << 62

    failed = next((runs[r] for r in sorted(range(nproc), key=written) if not runs[r].ok), None)
    return dataclasses.replace(failed if failed is not None else runs[highest_rank(peaks) or 0], rank_peaks=peaks)


def _collect(out: Path, variant: str, budget: float, label: str, measure_path: Path, log_name: str, rc: int | None,
             status: str | None, timeout: float | None, wall: float) -> Run:
    """One budget's Run from what its process left: the measurement JSON, else the capture."""
    cap_name = f"{label}.memprof"
    measured: Measured | None = None
    error: str | None = None
    meta: dict[str, Any] = {}
    if measure_path.exists():
        try:
            child = ChildResult.from_json(json.loads(measure_path.read_text()))
            measured, meta = child.measured, {"status": child.status, "exit_code": child.exit_code,
                                              "error": child.error}
        except (ValueError, KeyError, TypeError):
            pass
    if status is None:
        status = str(meta.get("status") or ("crashed" if rc != 0 else "completed"))
        if rc is not None and rc < 0 and status != "interrupted":  # (one a signal ended, saved: interrupted)
            status = "crashed"
    error = meta.get("error") or error
    own_rc = meta.get("exit_code", rc) if meta else rc
    if status == "timeout":
        error = f"stopped after {timeout:g} s (--timeout)" if timeout is not None else "stopped (timeout)"
    elif own_rc != 0 and not error:
        error = _last_line(out / log_name) or f"exit code {own_rc}"
    # a child that was killed leaves its spill, which load() recovers (the run cut short)
    capture = cap_name if (out / cap_name).exists() or spill_path(out / cap_name).exists() else None
    if measured is None and capture is not None:
        try:  # the child could not measure (or died after saving): measure the saved capture here
            from memprof.capture import load
            from memprof.sweep.measure import measure

            cap = load(out / cap_name)
            measured = measure(cap) if len(cap.raw) else None
            meta = {**cap.meta, **meta}
        except Exception as exc:
            error = error or f"capture unreadable ({one_line(exc)})"
    if status == "completed" and own_rc != 0:
        status = "exit"
    return Run(variant, budget, status, own_rc, error, capture, log_name, wall, measured)


def process_threads(cores: int, processes: int, gpu: bool, environ: dict[str, str]) -> dict[str, str]:
    """What each of `processes` sweep processes gets of the cores: cores / processes of Inductor's
    compile workers (its default, a pool of one worker per core in each process, oversubscribes)
    and, with a GPU, of torch's CPU threads (OMP_NUM_THREADS: processes of one OpenMP thread per core
    each made every compile slower: docs/benchmarks.md, "Figures behind design choices"). Without a
    GPU the scripts run on the CPU, where Inductor's code depends on the thread count, so the
    threads are left as torch sets them (the program measured is the program the user runs).
    A variable already set is left alone."""
    share = str(max(1, cores // max(1, processes)))
    names = ["TORCHINDUCTOR_COMPILE_THREADS"] + (["OMP_NUM_THREADS"] if gpu else [])
    return {name: share for name in names if name not in environ}


def group_tasks(budgets: Sequence[float], variants: Sequence[str], jobs: int, share: bool
                ) -> list[tuple[str, list[float]]]:
    """The processes of a sweep: (variant, budgets). Alone, one budget each. With `share` (--predict
    where this torch allows it), k = ceil(budgets / jobs) budgets per process, a variant's budgets
    dealt round-robin to ceil(its budgets / k) processes: the largest group sets the wall time, so
    the processes are as even as k allows and no more of them compete for the cores than that needs
    (26 budgets, 16 jobs: 13 processes of 2)."""
    if not share:
        return [(v, [b]) for b in budgets for v in variants]
    per = -(-len(budgets) * len(variants) // max(1, jobs))
    groups: list[tuple[str, list[float]]] = []
    for v in variants:
        n = -(-len(budgets) // per)
        groups += [(v, list(budgets[i::n])) for i in range(n)]
    return groups


def check_nproc(predict: bool, nproc: int) -> None:
    if predict and nproc > 1:
        raise MemprofError("--predict does not take --nproc: predictions compile one process per budget group "
                           "(the sweep measures torchrun jobs only)")


def out_of_device_memory(run: Run) -> bool:
    """A run that failed for want of device memory (an OOM, or a library's allocation failing)."""
    return run.status == "oom" or "CUBLAS_STATUS_ALLOC_FAILED" in (run.error or "")


def _again_alone(sweep: Sweep, out: Path, rerun: Callable[[str, list[float]], list[Run]]) -> None:
    """Predictions that ran out of device memory while the sweep's processes shared the device
    (their forwards take turns, but Inductor's compile also allocates there, e.g. to benchmark a
    padded matmul) are predicted again, one process at a time, with the device to themselves: one
    that runs out of memory then does not fit on its own."""
    failed = [r for r in sweep.runs if out_of_device_memory(r)]
    if not failed:
        return
    again: list[Run] = []
    for r in failed:
        log = out / r.log
        if log.is_file():  # the shared attempt's log is kept beside the new one
            record_files(out, str(log.with_suffix(".shared.log").relative_to(out)))
            log.replace(log.with_suffix(".shared.log"))
        again += rerun(r.variant, [r.budget])
    sweep.runs = [r for r in sweep.runs if r not in failed] + again
    fit = [r for r in again if r.ok]
    sweep.notes.append(f"{len(failed)} budget(s) ran out of device memory while the sweep's processes shared it "
                       f"and were predicted again alone: {len(fit)} then completed"
                       + ("" if len(fit) == len(again) else "; the others do not fit on the device by themselves"))


def _last_line(path: Path) -> str | None:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    for ln in reversed(lines):
        if not ln.startswith("memprof: capture saved") and not ln.startswith("memprof: partial capture"):
            return ln[:300]
    return None


def _process_notes(share: bool, tasks: int, groups: int, at_once: int, step_turns: bool, measured: bool,
                   gpus: int) -> list[str]:
    """What the table's readers need to know of how the processes ran."""
    notes = []
    if share:
        notes.append(f"{tasks} budgets predicted in {count(groups, 'process', 'processes')}: the budgets "
                     "of a process share the script's start, Dynamo's trace and the joint graph")
    if step_turns:
        notes.append(f"{at_once} processes compiled side by side; each timed its steps after the first "
                     "alone (no other process compiling or timing)")
    elif measured and at_once > 1:
        # (on a 2-core machine, --jobs 2 side by side timed the bundled example's steps at 1548.6 ms
        # against about 8 ms alone)
        notes.append(f"step times were measured with up to {at_once} processes running at once on "
                     f"{os.cpu_count() or 1} cores{' and the same GPU' if gpus and gpus < at_once else ''}: "
                     "they are not comparable between budgets; --jobs 1 measures each alone")
    return notes


def run_sweep(script: str, args: Sequence[str], budgets: Sequence[float], variants: Sequence[str], out: Path,
              jobs: int = 1, timeout: float | None = None, progress: Progress | None = None,
              env: dict[str, str] | None = None, predict: bool = False,
              noise: dict[str, float | None] | None = None, nproc: int = 1) -> Sweep:
    """Measure (or, with `predict`, only compile and estimate) every (variant, budget) in its own
    process; returns the sweep (also saved to out/sweep.json)."""
    check_nproc(predict, nproc)
    sweep = Sweep(command=[script, *args], budgets=list(budgets), variants=list(variants), runs=[],
                  mode="predict" if predict else "measure", nproc=nproc)
    if noise is not None:
        sweep.noise = dict(noise)
    gpus = visible_gpus()
    share = False
    if predict and len(budgets) * len(variants) > jobs:
        from memprof.torch_hooks.predict import sharing_available

        share = sharing_available()
    groups = group_tasks(budgets, variants, jobs, share)
    env = dict(env or {})
    env.update(process_threads(os.cpu_count() or 1, min(jobs, len(groups)) * nproc, bool(gpus),
                               {**os.environ, **env}))
    at_once = min(jobs, len(groups)) * nproc
    # measured runs side by side share the cores and the GPU: they compile together and time their
    # steps after the first one at a time (`sweep.turns`); a torchrun job's ranks run together
    step_turns = not predict and nproc == 1 and at_once > 1
    sweep.notes.extend(_process_notes(share, len(budgets) * len(variants), len(groups), at_once, step_turns,
                                      not predict, len(gpus)))
    pool = _Pool()
    lock = threading.Lock()
    # predicting processes take the device in turns for their forwards (sweep.predict.DeviceTurn)
    turns = predict and bool(gpus) and min(jobs, len(groups)) > 1

    def task(i: int) -> list[Run]:
        v, bs = groups[i]
        gpu = gpus[i % len(gpus)] if len(gpus) > 1 and nproc == 1 else None  # a torchrun job takes them all
        device_lock = out / "logs" / f"device{gpu if gpu is not None else ''}.lock" if turns else None
        if step_turns:
            device_lock = out / "logs" / "steps.lock"
        try:
            runs = _run_group(pool, out, script, args, v, bs, gpu, timeout, env, predict, device_lock, nproc)
        except OSError as exc:
            runs = [Run(v, b, "crashed", None, f"could not start: {exc}", None, "", 0.0) for b in bs]
        with lock:
            sweep.runs.extend(runs)
            sweep.save(out)
        if progress is not None:
            for run in runs:
                progress(run)
        return runs

    executor = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = [executor.submit(task, i) for i in range(len(groups))]
        for f in futures:
            while True:
                try:
                    f.result(timeout=0.5)
                    break
                except TimeoutError:
                    continue
    except KeyboardInterrupt:
        pool.stop()
        executor.shutdown(wait=True, cancel_futures=True)
        sweep.notes.append("interrupted (Ctrl-C): budgets not run are missing")
        sweep.runs.sort(key=lambda r: (r.variant, r.budget))
        sweep.save(out)
        raise
    executor.shutdown(wait=True)
    if turns:
        alone = None if len(gpus) < 2 else gpus[0]
        _again_alone(sweep, out, lambda v, bs: _run_group(pool, out, script, args, v, bs, alone, timeout, env, predict))
    sweep.runs.sort(key=lambda r: (r.variant, r.budget))
    _closing_notes(sweep)
    sweep.save(out)
    return sweep


def _closing_notes(sweep: Sweep) -> None:
    """What the finished sweep's runs leave out or mean, as notes."""
    unprobed: dict[str, dict[str, None]] = {}  # why -> ops
    for r in sweep.runs:
        for op, why in (r.measured.estimate_unprobed if r.measured else []):
            unprobed.setdefault(why, {})[op] = None
    if unprobed:
        sweep.notes.append("memprof's estimate leaves out the scratch memory of fallback kernels it could not run ("
                           + "; ".join(f"{why}: {', '.join(ops)}" for why, ops in unprobed.items()) + ")")
    if sweep.mode == "predict" and sweep.never_compiled():
        sweep.notes.append("the script compiled no graph with a backward before its first backward call: "
                           "nothing to predict")
    if sweep.never_compiled() and sweep.mode != "predict":
        sweep.notes.append("the script never called torch.compile on a model it trained (no compiled graph with a "
                           "backward was recorded): the budget has no effect; the peaks are eager peaks")
