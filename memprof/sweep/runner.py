"""Running a sweep: one `memprof trace` process per (variant, budget), `jobs` at a time.

Each process writes its capture and a small JSON of what `memprof.sweep.measure` found (computed
in the child, from the capture still in memory). A process that fails is recorded with its status
and the sweep goes on; Ctrl-C stops the running processes (their partial captures are saved) and
writes what is done.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from memprof.errors import MemprofError
from memprof.sweep.result import Run, Sweep
from memprof.sweep.spec import budget_label

Progress = Callable[[Run], None]


def prepare_dir(out: Path, force: bool) -> None:
    if out.exists():
        if not out.is_dir():
            raise MemprofError(f"output {out} exists and is not a directory")
        if any(out.iterdir()):
            if not force:
                raise MemprofError(f"output directory {out} exists and is not empty (use --force to replace it)")
            if not (out / "sweep.json").exists() and not any(out.glob("*.memprof")):
                raise MemprofError(f"output directory {out} holds files that are not a sweep's; not replacing it")
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)


def _gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v for v in visible.split(",") if v.strip()]
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


def _run_one(pool: _Pool, out: Path, script: str, args: Sequence[str], variant: str, budget: float,
             gpu: str | None, timeout: float | None, extra_env: dict[str, str], predict: bool = False) -> Run:
    label = f"{variant}_{budget_label(budget)}"
    cap_name = f"{label}.memprof"
    log_name = f"logs/{label}.log"
    measure_path = out / "logs" / f"{label}.json"
    if predict:
        cmd = [sys.executable, "-m", "memprof.sweep.predict", "--budget", repr(budget), "--json", str(measure_path)]
    else:
        cmd = [sys.executable, "-m", "memprof", "trace", "--budget", repr(budget), "-o", str(out / cap_name),
               "--force", "--measure-json", str(measure_path)]
    if variant != "stock":
        cmd += ["--remat", variant]
    cmd += [script, "--", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    t0 = time.monotonic()
    status = None
    with open(out / log_name, "wb") as log:
        with pool.lock:
            if pool.stopping:
                return Run(variant, budget, "interrupted", None, "not started (interrupted)", None, log_name, 0.0)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            pool.procs.add(proc)
        try:
            rc = proc.wait(timeout=timeout)
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
    wall = time.monotonic() - t0
    measured: dict[str, Any] | None = None
    error: str | None = None
    meta: dict[str, Any] = {}
    if measure_path.exists():
        try:
            d = json.loads(measure_path.read_text())
            measured, meta = d.get("measured"), d.get("meta", {})
        except ValueError:
            pass
    if status is None:
        status = str(meta.get("status") or ("crashed" if rc != 0 else "completed"))
        if rc is not None and rc < 0:
            status = "crashed"
    error = meta.get("error") or error
    if status == "timeout":
        error = f"stopped after {timeout:g} s (--timeout)"
    elif rc != 0 and not error:
        error = _last_line(out / log_name) or f"exit code {rc}"
    capture = cap_name if (out / cap_name).exists() else None
    if measured is None and capture is not None:
        try:  # the child could not measure (or died after saving): measure the saved capture here
            from memprof.fileformat import load
            from memprof.sweep.measure import measure

            cap = load(out / cap_name)
            measured = measure(cap).to_json() if len(cap.raw) else None
            meta = {**cap.meta, **meta}
        except Exception as exc:
            error = error or f"capture unreadable ({type(exc).__name__}: {exc})"
    if status == "completed" and rc != 0:
        status = "exit"
    return Run(variant, budget, status, rc, error, capture, log_name, round(wall, 2), measured)


def _last_line(path: Path) -> str | None:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    for ln in reversed(lines):
        if not ln.startswith("memprof: capture saved") and not ln.startswith("memprof: partial capture"):
            return ln[:300]
    return None


def run_sweep(script: str, args: Sequence[str], budgets: Sequence[float], variants: Sequence[str], out: Path,
              jobs: int = 1, timeout: float | None = None, progress: Progress | None = None,
              env: dict[str, str] | None = None, predict: bool = False,
              noise: dict[str, float] | None = None) -> Sweep:
    """Measure (or, with `predict`, only compile and estimate) every (variant, budget) in its own
    process; returns the sweep (also saved to out/sweep.json)."""
    sweep = Sweep(command=[script, *args], budgets=list(budgets), variants=list(variants), runs=[],
                  mode="predict" if predict else "measure")
    if noise is not None:
        sweep.noise = dict(noise)
    gpus = _gpus()
    tasks = [(v, b) for b in budgets for v in variants]
    env = dict(env or {})
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ and "TORCHINDUCTOR_COMPILE_THREADS" not in env:
        # the cores are shared by the jobs: each process compiles Triton kernels with its share
        # (Inductor's default, a pool of one worker per core in each of N processes, oversubscribes)
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, min(jobs, len(tasks)))))
    pool = _Pool()
    lock = threading.Lock()

    def task(i: int) -> Run:
        v, b = tasks[i]
        gpu = gpus[i % len(gpus)] if len(gpus) > 1 else None
        try:
            run = _run_one(pool, out, script, args, v, b, gpu, timeout, env, predict)
        except OSError as exc:
            run = Run(v, b, "crashed", None, f"could not start: {exc}", None, "", 0.0)
        with lock:
            sweep.runs.append(run)
            sweep.save(out)
        if progress is not None:
            progress(run)
        return run

    executor = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = [executor.submit(task, i) for i in range(len(tasks))]
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
    sweep.runs.sort(key=lambda r: (r.variant, r.budget))
    if predict and sweep.never_compiled():
        sweep.notes.append("the script compiled no graph with a backward before its first backward call: "
                           "nothing to predict")
    if sweep.never_compiled() and not predict:
        sweep.notes.append("the script never called torch.compile on a model it trained (no compiled graph with a "
                           "backward was recorded): the budget has no effect; the peaks are eager peaks")
    sweep.save(out)
    return sweep
