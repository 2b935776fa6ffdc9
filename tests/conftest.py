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


def run_memprof(*args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None,
                ) -> subprocess.CompletedProcess[str]:
    """Run `python -m memprof ARGS` in a subprocess (as a user would)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "memprof", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)
