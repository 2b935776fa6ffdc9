from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from _examples import load_example  # noqa: E402  (the one loader of examples/train_<model>.py)

__all__ = ["ROOT", "invoke_memprof", "load_example", "one_line_error", "run_memprof"]

_CACHE_KEY = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    # Compiled graphs are cached across processes under TORCHINDUCTOR_CACHE_DIR (AOTAutograd's
    # and Inductor's caches stay on under capture): a suite that read a cache an earlier run left
    # behind would pass or fail by what that machine ran before, so each run starts empty.
    cache = tempfile.mkdtemp(prefix="memprof-tests-inductor-")
    config.stash[_CACHE_KEY] = cache
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    # pytest-xdist 3.6+ hands out files by their count of tests, most first, unless told not to: the
    # heaviest files (few tests, minutes each) went last and one worker ran them alone at the end
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(config.stash.get(_CACHE_KEY, ""), ignore_errors=True)


# The files that compile and run the most (a minute or more of a 2-core machine's time each),
# longest first (--durations=0 on a clean clone). Collected first, they go to the worker processes
# first (pytest-xdist hands out whole files in collection order: see pytest_configure), so that no
# worker starts one of them while the others are finishing: collected in name order,
# test_remat.py and test_sweep.py came last and one worker ran alone for a minute or more at the end.
HEAVIEST_FILES = ("test_sweep.py", "test_remat.py", "test_fit.py", "test_ranks.py", "test_attribution.py",
                  "test_step_windows.py", "test_as_python.py", "test_fit_runs.py", "test_warm_compiles.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    """The single `memprof: error:` line of a failed run: no traceback, and memprof's only line on
    stderr (warnings torch prints are not memprof's and may come and go with its version)."""
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("memprof")]
    assert len(lines) == 1 and lines[0].startswith("memprof: error:"), res.stderr
    return lines[0]


def run_memprof(*args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None,
                ) -> subprocess.CompletedProcess[str]:
    """Run `python -m memprof ARGS` in a subprocess (as a user would)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "memprof", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def invoke_memprof(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`memprof ARGS` in this process, through the CLI's own entry point (its one-line errors and
    exit codes), with `cwd` as the working directory: report, export, bad input refused before
    anything runs, and traces of small scripts that exit normally (a script that kills its
    process, or whose signals must reach a real process, runs under `run_memprof`)."""
    from memprof.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in (env or {})}
    old = Path.cwd()
    os.chdir(cwd)
    os.environ.update(env or {})
    code: int
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(old)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["memprof", *args], code, out.getvalue(), err.getvalue())
