"""The zoo's training scripts (examples/train_gpt2.py, train_gqa.py, train_vit.py) as a user runs
them: unmodified under `memprof trace`, and a missing optional package said in one line. Eager
here (compiling each costs a minute on the CPU); the compiled GPT-2 is the committed fixture of
tests/unit/test_zoo_estimate.py, and every script runs compiled at full size on the GPU machine
(docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import memprof

from ..conftest import ROOT, run_memprof


@pytest.mark.parametrize("script", ["train_gpt2.py", "train_gqa.py", "train_vit.py"])
def test_each_zoo_script_runs_under_trace(script: str, tmp_path: Path) -> None:
    out = tmp_path / "run.memprof"
    res = run_memprof("trace", "-o", str(out), str(ROOT / "examples" / script), "--steps", "2", "--no-compile",
                      cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 2: loss" in res.stdout
    cap = memprof.load(out)
    steps = cap.steps("cpu")
    assert len(steps) >= 2 and cap.exact
    # bf16 autocast by default: the forward made bf16 copies of the fp32 weights
    assert any("aten::_to_copy" in cap.scope_name(int(s)) for s in set(cap.raw["scope"].tolist()))


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed here")
def test_a_missing_package_is_one_line() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "train_vit.py"), "--impl", "timm"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == "train_vit.py: error: --impl timm needs the package timm: pip install timm"
