"""memprof sweep: budget specs, non-monotone detection on synthetic curves, and a real sweep of a
small model end to end (table, sweep.json, plot, flags, diagnosis, a failing budget)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import memprof
from memprof.errors import MemprofError
from memprof.sweep import load_sweep, non_monotone, parse_budgets, spearman, worst_per_budget
from memprof.sweep.detect import tolerance
from memprof.sweep.measure import measure

from .conftest import ROOT, run_memprof

MB = 1_000_000


def test_budget_specs() -> None:
    assert parse_budgets("0.05,0.1,0.3") == [0.05, 0.1, 0.3]
    assert parse_budgets("0.3, 0.05,0.05") == [0.05, 0.3]
    grid = parse_budgets("0.05:0.30:0.01")
    assert len(grid) == 26 and grid[0] == 0.05 and grid[-1] == 0.3 and grid[2] == 0.07
    assert parse_budgets("0.0:0.3:0.1,1.0") == [0.0, 0.1, 0.2, 0.3, 1.0]
    assert parse_budgets("0:0.25:0.1") == [0.0, 0.1, 0.2]  # STOP only when a step reaches it


@pytest.mark.parametrize("spec, message", [
    ("", "empty"), ("  ", "empty"), ("0.1,,0.2", "empty item"), ("1.5", "outside [0, 1]"), ("-0.1", "outside"),
    ("0:0.3:0", "step must be > 0"), ("0:0.3:-0.1", "step must be > 0"), ("0.3:0.1:0.1", "below START"),
    ("abc", "not a number"), ("0.1:0.2", "START:STOP:STEP"), ("nan", "finite"), ("0:1:0.0000001", "at most"),
])
def test_malformed_budget_specs(spec: str, message: str) -> None:
    with pytest.raises(MemprofError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_budgets(spec)


def test_detection_on_synthetic_curves() -> None:
    # the H200 reference curve (shared/reference): 0.0-0.10 all above the 0.13 minimum, and 1.0 above all but 0.0
    ref = [(0.0, 1141.2), (0.05, 901.5), (0.10, 586.0), (0.13, 363.3), (0.15, 383.7), (0.20, 415.1),
           (0.30, 473.8), (1.0, 1110.2)]
    flags = non_monotone([(b, int(p * MB)) for b, p in ref])
    pairs = {(f.low, f.high) for f in flags}
    expected = {(a, b) for i, (a, pa) in enumerate(ref) for b, pb in ref[i + 1:] if pa > pb}
    assert pairs == expected
    worst = worst_per_budget(flags)
    assert [(f.low, f.high) for f in worst] == [(0.0, 0.13), (0.05, 0.13), (0.10, 0.13)]
    assert worst[1].excess == int(901.5 * MB) - int(363.3 * MB)
    # a monotone curve, a curve wiggling within the noise, and missing points
    assert non_monotone([(0.1, 500 * MB), (0.2, 600 * MB), (0.3, 700 * MB)]) == []
    assert non_monotone([(0.1, 190_400_000), (0.2, 189_800_000), (0.3, 189_200_000)]) == []  # rerun noise
    assert non_monotone([(0.1, None), (0.2, 100 * MB), (0.3, None)]) == []
    # the noise threshold: max(1.5 MB, 0.5%)
    assert tolerance(100 * MB) == 1_500_000 and tolerance(1000 * MB) == 5 * MB
    assert [(f.low, f.high) for f in non_monotone([(0.1, 101_600_000), (0.2, 100 * MB)])] == [(0.1, 0.2)]
    assert non_monotone([(0.1, 101_400_000), (0.2, 100 * MB)]) == []
    assert non_monotone([(0.1, 101_600_000), (0.2, 100 * MB)], abs_tol=2 * MB) == []


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [1, 3, 2, 5, 4]) == pytest.approx(0.8)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)  # ties: average ranks
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None


def _one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("memprof: error:"), res.stderr
    return lines[0]


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    for spec, needle in [("", "empty"), ("0.1:0.3:0", "step must be > 0"), ("2", "outside [0, 1]")]:
        assert needle in _one_line_error(run_memprof("sweep", "train.py", "--budgets", spec, cwd=tmp_path))
    assert "does not exist" in _one_line_error(run_memprof("sweep", "nope.py", "--budgets", "0.1", cwd=tmp_path))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sweep.json").write_text("{}")
    line = _one_line_error(run_memprof("sweep", "train.py", "--budgets", "0.1", "-o", "out", cwd=tmp_path))
    assert "exists" in line and "--force" in line
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    line = _one_line_error(run_memprof("sweep", "train.py", "--budgets", "0.1", "-o", "other", "--force",
                                       cwd=tmp_path))
    assert "not a sweep" in line and (tmp_path / "other" / "notes.txt").exists()


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A real sweep: TinyLlama (6 layers) under aot_eager, 4 budgets, 2 at a time; budget 0.0 crashes."""
    tmp = tmp_path_factory.mktemp("sweep")
    shutil.copy(ROOT / "tests" / "sweep_train.py", tmp / "sweep_train.py")
    shutil.copy(ROOT / "tests" / "remat_models.py", tmp / "remat_models.py")
    res = run_memprof("sweep", "sweep_train.py", "--budgets", "0.0,0.02,0.1,1.0", "--jobs", "2", "-o", "out",
                      "--crash-below", "0.01", cwd=tmp, timeout=900)
    return tmp / "out", res


@pytest.mark.slow
def test_sweep_end_to_end(small_sweep: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, res = small_sweep
    assert res.returncode == 0, res.stderr[-3000:]
    sweep = load_sweep(out)
    assert [r.budget for r in sweep.runs] == [0.0, 0.02, 0.1, 1.0] and sweep.variants == ["stock"]
    crashed = sweep.runs[0]
    assert crashed.status == "exception" and not crashed.ok and "deliberate failure" in (crashed.error or "")
    assert crashed.capture is not None and (out / crashed.capture).exists()  # the partial capture is kept
    for r in sweep.runs[1:]:
        assert r.ok and r.measured is not None and r.measured["compiled"] and r.measured["steps"] == 3
        # the step peak is exact: recomputed here from the capture's own timeline
        assert r.capture is not None
        cap = memprof.load(out / r.capture)
        m = measure(cap, attribution=False)
        assert m.step_peak == r.step_peak and m.step_peaks == r.measured["step_peaks"]
        tl = cap.timeline("cpu")
        assert r.step_peak is not None and 0 < r.step_peak <= tl.peak - tl.baseline
    # the knapsack at 0.02 recomputes more and peaks higher than at 0.1: flagged and explained
    flags = {(f.low, f.high) for f in sweep.flags()}
    assert (0.02, 0.1) in flags
    peaks = {r.budget: r.step_peak for r in sweep.runs}
    assert all(peaks[a] > peaks[b] for a, b in flags if peaks[a] and peaks[b])  # type: ignore[operator]
    diag = {d.low: d for d in sweep.diagnoses()}
    text = "\n".join(diag[0.02].lines)
    assert "selection:" in text and "recomputes" in text and "lifetime:" in text
    f02, f10 = sweep.runs[1].facts, sweep.runs[2].facts
    assert f02 is not None and f10 is not None
    assert f02.saved_bytes < f10.saved_bytes and f02.recomputed_bytes > f10.recomputed_bytes
    # terminal output, json, plot
    assert "| 0.02" in res.stdout and "EXCEPTION" in res.stdout and "more than 0.1" in res.stdout
    assert "less budget, more memory" in res.stdout
    d = json.loads((out / "sweep.json").read_text())
    assert d["analysis"]["stock"]["flags"] and d["analysis"]["stock"]["diagnoses"]
    for ext in ("png", "svg"):
        assert (out / f"sweep.{ext}").stat().st_size > 10_000
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "4/4" in res.stderr


@pytest.mark.slow
def test_sweep_of_a_script_that_never_compiles(tmp_path: Path) -> None:
    shutil.copy(ROOT / "tests" / "sweep_train.py", tmp_path / "sweep_train.py")
    shutil.copy(ROOT / "tests" / "remat_models.py", tmp_path / "remat_models.py")
    res = run_memprof("sweep", "sweep_train.py", "--budgets", "0.1,0.5", "--jobs", "2", "--no-plot", "--eager",
                      "--layers", "2", "--steps", "2", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "never called torch.compile" in res.stdout
    sweep = load_sweep(tmp_path / "sweep_sweep_train")
    peaks = [r.step_peak for r in sweep.runs]
    assert all(p is not None and p > 0 for p in peaks)
    assert np.ptp(np.array(peaks)) == 0  # eager: the budget changes nothing, to the byte
    assert not any((r.measured or {}).get("compiled") for r in sweep.runs)
