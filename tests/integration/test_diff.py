"""`memprof diff` and `memprof.analysis.diff.diff`: what changed between two real captures, rows that
sum to the difference to the byte, the regression gate, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import memprof
from memprof.analysis.diff import diff
from memprof.errors import MemprofError

from ..conftest import invoke_memprof, one_line_error

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _step(batch: int) -> memprof.Capture:
    """One eager training step of a small MLP (the same weights, `batch` rows)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(batch, 64)
    with memprof.capture() as cap:
        model(x).square().mean().backward()
    return cap


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("diff")
    a, b = d / "a.memprof", d / "b.memprof"
    _step(32).save(a)
    _step(128).save(b)
    return a, b


def test_rows_sum_to_the_difference_of_the_peaks_to_the_byte(pair: tuple[Path, Path]) -> None:
    a, b = memprof.load(pair[0]), memprof.load(pair[1])
    d = diff(a, b)
    assert (d.a_total, d.b_total) == (a.peak(), b.peak())
    assert d.delta == b.peak() - a.peak() > 0
    for by in ("category", "node", "layer", "kernel"):
        assert sum(r.delta for r in d.rows[by]) == d.delta, by
    rows = {r.key: r for r in d.rows["node"]}
    # the first linear's output and the GELU's, saved for the backward, grow with the batch: 4x
    gelu = rows["eager:aten::gelu"]
    assert gelu.b_bytes == 4 * gelu.a_bytes == 128 * 256 * 4 and gelu.category == "saved_activation"
    assert [r.key for r in d.rows["category"]][:2] == ["saved_activation", "temporary"]  # largest change first


def test_the_cli_prints_json_and_gates_on_growth(pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = pair
    res = invoke_memprof("diff", str(a), str(b), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["delta_bytes"] == out["b_bytes"] - out["a_bytes"] == 319_488
    assert sum(r["delta"] for r in out["by"]["kernel"]) == 319_488
    text = invoke_memprof("diff", str(a), str(b), "--by", "category", cwd=tmp_path)
    assert "B - A +319.5 kB (+319,488 B)" in text.stdout and "by node" not in text.stdout
    assert "(1 row unchanged)" in text.stdout
    # the gate: B grew by 319,488 B (185%)
    for limit, code in (("319488", 0), ("319487B", 1), ("0.5MB", 0), ("186%", 0), ("185%", 1)):
        res = invoke_memprof("diff", str(a), str(b), "--fail-above", limit, "--by", "category", cwd=tmp_path)
        assert res.returncode == code, (limit, res.stderr)
        if code:
            assert "more than --fail-above" in res.stderr
    # the page: each table's rows sum to the difference; nothing fetched, no script
    res = invoke_memprof("diff", str(a), str(b), "--html", "d.html", "--top", "3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    page = (tmp_path / "d.html").read_text()
    assert "<script" not in page and "default-src 'none'" in page and 'data-delta="319488"' in page
    for table in page.split("<h2>by ")[1:]:
        assert sum(int(v) for v in re.findall(r'<tr data-delta="(-?\d+)"', table)) == 319_488
    assert "already exists" in one_line_error(invoke_memprof("diff", str(a), str(b), "--html", "d.html", cwd=tmp_path))
    # shrinking never fails the gate
    assert invoke_memprof("diff", str(b), str(a), "--fail-above", "0B", cwd=tmp_path).returncode == 0


def test_bad_input_is_one_line(pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = pair
    with memprof.capture() as empty:
        pass
    empty.save(tmp_path / "empty.memprof")
    cases = {
        ("diff", str(a), str(a)): "the same file",
        ("diff", str(a), str(tmp_path / "empty.memprof")): "recorded no allocations",
        ("diff", str(a), str(FIXTURES / "tiny_compiled_cuda.memprof")): "different devices",
        ("diff", str(a), str(b), "--device", "cuda:0"): "has no allocations on cuda:0",
        ("diff", str(a), str(b), "--at", "step:7"): "no step 7",
        ("diff", str(a), str(b), "--fail-above", "lots"): "is not a size",
        ("diff", str(a), str(b), "--fail-above", "-5%"): "not a percentage",
        ("diff", str(a), str(tmp_path / "missing.memprof")): "no such file",
    }
    for args, words in cases.items():
        assert words in one_line_error(invoke_memprof(*args, cwd=tmp_path)), args


def test_a_gpu_job_is_compared_on_the_device_named(pair: tuple[Path, Path]) -> None:
    cuda = memprof.load(FIXTURES / "tiny_compiled_cuda.memprof")  # a CUDA run's capture: cpu and cuda:0
    cpu = memprof.load(pair[0])
    with pytest.raises(MemprofError, match="different devices"):
        diff(cpu, cuda)
    d = diff(cpu, cuda, device="cpu")  # the CUDA job's host side
    assert d.b_total == cuda.peak("cpu") and d.device == "cpu"
    assert sum(r.delta for r in d.rows["node"]) == d.delta
