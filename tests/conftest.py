from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

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
