"""Attribution, reporters, the Chrome validator and the report/export commands on the committed
captures (tests/fixtures, written by tools/make_fixtures.py on the CPU and on the GPU machine):
nothing is compiled or run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memprof
from memprof.analysis.attribution import BY, CATEGORIES, Category
from memprof.analysis.summary import summarize
from memprof.plans import KnownTensor, KnownTensors
from memprof.reporters import render
from memprof.reporters.chrome import validate_chrome_trace

from ..conftest import invoke_memprof, one_line_error

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURES = sorted(FIXTURES.glob("*.memprof"))


@pytest.fixture(params=CAPTURES, ids=[p.stem for p in CAPTURES])
def cap(request: pytest.FixtureRequest) -> memprof.Capture:
    return memprof.load(request.param)


def test_fixtures_are_small() -> None:
    assert CAPTURES and all(p.stat().st_size < 1_000_000 for p in CAPTURES)


def test_attribution_sums_to_the_peak_to_the_byte(cap: memprof.Capture) -> None:
    dev = cap.main_device
    peak = cap.peak(dev)
    for by in BY:
        rows = cap.attribution(at="peak", by=by, device=dev)
        assert sum(r.bytes for r in rows) == peak, by
    for s in cap.steps(dev):
        assert sum(r.bytes for r in cap.attribution(at=f"step:{s.step}", device=dev)) == s.peak
    cats = {r.key for r in cap.attribution(at="peak", device=dev)}
    assert cats <= set(CATEGORIES) and "gradient" in cats
    # every compiled-graph call is joined to its wrapper code, buffer by buffer (where the capture
    # recorded the calls' scopes: `--scopes ops`)
    calls = cap.labels(dev).calls
    if cap.meta.get("scopes", "ops") == "ops":
        assert calls and all(c.level == "buffer" for c in calls), [c.reason for c in calls if c.level != "buffer"]
    elif cap.meta.get("scopes") == "graphs":  # the calls are recorded, without op scopes to join extern ops
        assert calls


def test_cuda_capture_equals_pytorchs_own_counters() -> None:
    path = FIXTURES / "tiny_compiled_cuda.memprof"
    if not path.exists():
        pytest.skip("no CUDA fixture (tools/make_fixtures.py --cuda on a GPU machine)")
    cap = memprof.load(path)
    expected = cap.meta["expected"]
    assert cap.peak("cuda:0") == expected["max_memory_allocated"]
    steps = cap.steps("cuda:0")
    assert [[s.allocated_at_end, s.reserved_at_end] for s in steps if s.complete] == expected["step_ends"]


def test_reporters_agree_with_the_summary(cap: memprof.Capture) -> None:
    summary = summarize(cap)
    assert json.loads(render("json", cap)) == json.loads(json.dumps(summary.to_json()))
    text = render("text", cap)
    dev = summary.devices[-1]
    assert f"{dev.peak_bytes:,}" in text and "by category:" in text and "compile plan 0" in text
    table = json.loads(render("table-json", cap, by="node"))
    assert table["exact"] and table["bytes"] == cap.peak(cap.main_device)


def test_chrome_export_is_valid(cap: memprof.Capture) -> None:
    trace = json.loads(render("chrome", cap))
    assert validate_chrome_trace(trace) == []
    peaks = [e for e in trace["traceEvents"] if e.get("cat") == "peak"]
    assert {e["args"]["bytes"] for e in peaks} == {cap.peak(d) for d in cap.devices if cap.timeline(d).peak_pos >= 0}


def test_report_and_export_commands(tmp_path: Path) -> None:
    path = str(CAPTURES[0])
    res = invoke_memprof("report", path, "--by", "layer", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert rows["bytes"] == sum(r["bytes"] for r in rows["rows"])
    res = invoke_memprof("export", path, "--format", "chrome", "-o", "t.json", cwd=tmp_path)
    assert res.returncode == 0 and validate_chrome_trace(json.loads((tmp_path / "t.json").read_text())) == []
    assert "already exists" in one_line_error(invoke_memprof("export", path, "--format", "chrome", "-o", "t.json",
                                                             cwd=tmp_path))
    assert "no step 99" in one_line_error(invoke_memprof("report", path, "--by", "node", "--at", "step:99",
                                                         cwd=tmp_path))


@pytest.mark.parametrize("how", ["capture ends", "oom"])
def test_a_call_cut_short_is_still_joined_buffer_by_buffer(how: str) -> None:
    """An OOM (or a kill) stops a compiled graph's call midway: what it allocated so far is a prefix
    of its wrapper's allocations, and is joined to buffers and FX nodes, not guessed from lifetimes.
    After an OOM the call's scope still closes (the exception unwinds it)."""
    import numpy as np

    from memprof._events import Kind

    cap = memprof.load(FIXTURES / "tiny_compiled.memprof")
    dev = cap.main_device
    call = next(c for c in cap.labels(dev).calls if c.role == "backward")
    tl = cap.timeline(dev)
    inside = [int(r) for r, a in zip(tl.rows, tl.is_alloc, strict=True) if a and call.begin_row < r < call.end_row]
    assert len(inside) >= 2
    cut = inside[len(inside) // 2] + 1  # just after an allocation inside the call
    raw = cap.raw.records(0, cut)
    if how == "oom":
        oom = raw[-1:].copy()
        oom["kind"], oom["bytes"], oom["aux"] = Kind.OOM, 1 << 40, 0
        raw = np.concatenate([raw, oom, cap.raw.records(call.end_row, call.end_row + 1)])  # then the call's end
    short = memprof.Capture(raw=raw, strings=cap.strings, meta=dict(cap.meta, status="oom"),
                            threads=cap.threads, plans=cap.plans, graphs=cap.graphs, tensors=cap.tensors)
    joined = [c for c in short.labels(dev).calls if c.begin_row == call.begin_row]
    assert joined and joined[0].level == "buffer" and "cut short" in joined[0].reason
    rows = short.attribution(at="peak", by="node", device=dev, lower_bound=True)
    assert sum(r.bytes for r in rows) == short.peak(dev, lower_bound=True)
    # what the cut call allocated is in flight, not the step's gradients, unless it is one: a gradient
    # the optimizer later names (a known tensor) or a buffer the wrapper returns
    labels, stl = short.labels(dev), short.timeline(dev)
    mine = [p for p in range(len(stl.rows)) if stl.is_alloc[p] and call.begin_row < stl.rows[p] < cut]
    assert mine and any(labels.category[p] != Category.GRADIENT for p in mine)
    assert all(labels.names[labels.node[p]].startswith("gradient:") for p in mine
               if labels.category[p] == Category.GRADIENT)


def test_the_step_table_has_each_steps_exact_figures(cap: memprof.Capture) -> None:
    dev = cap.main_device
    tl = cap.timeline(dev)
    rows = json.loads(render("table-json", cap, by="step"))["rows"]
    steps = cap.steps(dev)
    assert [r["step"] for r in rows] == [s.step for s in steps]
    for r, s in zip(rows, steps, strict=True):
        assert r["peak_bytes"] == s.peak and r["allocated_at_end"] == s.allocated_at_end
        assert r["allocated_at_start"] == tl.allocated_before_row(s.start_row)
        assert r["rise_bytes"] == s.peak - r["allocated_at_start"] >= 0
        assert r["duration_ms"] == pytest.approx((s.t_end_ns - s.t_start_ns) / 1e6)
    text = render("table", cap, by="step")
    assert f"{max(s.peak for s in steps):,}" in text and "highest" in text


def test_a_ddp_bucket_a_gloo_thread_frees_is_still_the_bucket() -> None:
    """DDP's rebuilt bucket, freed at the end by one of gloo's threads, is the bucket at every step; the
    bucket layout the rebuild broadcasts before it (a few int32 bytes gloo lets go of after the call)
    is not."""
    import sys

    sys.path.insert(0, str(FIXTURES.parents[1] / "tools"))
    from make_fixtures import bucket_freed_elsewhere

    cap = memprof.load(FIXTURES / "ddp_rank_cpu.memprof")
    assert bucket_freed_elsewhere(cap)  # what the fixture is for (tools/make_fixtures.py --ddp)
    params = (64 * 256 + 256 + 256 * 64 + 64) * 4  # the Linear(64, 256), Linear(256, 64) of test_ranks' script
    steps = cap.steps("cpu")
    assert len(steps) == 3
    for s in steps:
        rows = {r.key: r.bytes for r in cap.attribution(at=f"step:{s.step}", by="category")}
        assert rows.get("ddp_bucket") == params, (s.step, rows)


def test_known_tensors_in_columns_read_as_the_records() -> None:
    """`KnownTensors` (the recorder's columns) reads back every record of the committed captures as
    it was, by index, slice and iteration, and prunes as the list does."""
    records = [t for p in CAPTURES for t in memprof.load(p).tensors]
    assert {t.category for t in records} >= {"parameter", "gradient", "optimizer_state"}
    cols = KnownTensors(records)
    assert len(cols) == len(records) and list(cols) == records
    assert cols[-1] == records[-1] and cols[3:10:2] == records[3:10:2] and cols[len(records):] == []
    with pytest.raises(IndexError):
        cols[len(records)]
    for a, b in ((0, len(records)), (3, 11), (5, 5)):  # what the spill writes, as json.dumps wrote it
        assert cols.json_rows(a, b) == json.dumps([t.to_json() for t in records[a:b]], separators=(",", ":"))
    for before in [*sorted({t.t_ns for t in records})[:: max(1, len(records) // 7)], 0, 2**62]:
        pruned = cols.pruned(before)
        expected = _pruned_reference(records, before)
        assert (list(pruned) if pruned is not None else records) == expected, before
        assert (pruned is None) == (len(expected) == len(records))


def _pruned_reference(tensors: list[KnownTensor], before_ns: int) -> list[KnownTensor]:
    """`KnownTensors.pruned`'s rule one record at a time: every record from `before_ns` on, and of
    the earlier ones the last at each (device, address)."""
    last: dict[tuple[str, int], int] = {}
    for i, t in enumerate(tensors):
        if t.t_ns < before_ns:
            last[(t.device, t.ptr)] = i
    keep = set(last.values())
    return [t for i, t in enumerate(tensors) if t.t_ns >= before_ns or i in keep]
