"""Chrome/Perfetto export: structure, the peak marker, and the validator's rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import memprof
from memprof.reporters import render
from memprof.reporters.chrome import chrome_trace, validate_chrome_trace


@pytest.fixture(scope="module")
def cap() -> memprof.Capture:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters())
    with memprof.capture() as cap:
        for _ in range(3):
            model(torch.randn(64, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    return cap


def test_export_is_valid_and_complete(cap: memprof.Capture) -> None:
    trace = json.loads(render("chrome", cap))
    assert validate_chrome_trace(trace) == []
    evs = trace["traceEvents"]
    names = {(e["ph"], e["name"]) for e in evs}
    assert ("M", "process_name") in names
    counters = [e for e in evs if e["ph"] == "C" and e["name"] == "allocated"]
    assert max(e["args"]["bytes"] for e in counters) == cap.peak("cpu")
    peaks = [e for e in evs if e["ph"] == "i" and e.get("cat") == "peak"]
    assert len(peaks) == 1 and peaks[0]["args"]["bytes"] == cap.peak("cpu")
    steps = [e for e in evs if e.get("cat") == "step"]
    assert [e["name"] for e in steps] == ["step 1", "step 2", "step 3"]
    slices = [e for e in evs if e["ph"] == "X"]
    assert any(e["name"] == "aten::addmm" for e in slices)
    assert any(e["cat"] == "backward" for e in slices)


def test_downsampled_counter_keeps_the_exact_peak(cap: memprof.Capture) -> None:
    trace = chrome_trace(cap, max_counter_points=16)
    assert validate_chrome_trace(trace) == []
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "allocated"]
    assert len(counters) <= 20
    assert max(e["args"]["bytes"] for e in counters) == cap.peak("cpu")


def _trace(*events: dict[str, object]) -> dict[str, object]:
    return {"traceEvents": list(events)}


def test_validator_rules() -> None:
    ok = _trace({"ph": "X", "pid": 0, "tid": 1, "name": "a", "ts": 0, "dur": 10},
                {"ph": "X", "pid": 0, "tid": 1, "name": "b", "ts": 2, "dur": 3},
                {"ph": "C", "pid": 1, "name": "allocated", "ts": 4, "args": {"bytes": 5}})
    assert validate_chrome_trace(ok) == []
    overlap = _trace({"ph": "X", "pid": 0, "tid": 1, "name": "a", "ts": 0, "dur": 10},
                     {"ph": "X", "pid": 0, "tid": 1, "name": "b", "ts": 5, "dur": 10})
    assert any("without nesting" in p for p in validate_chrome_trace(overlap))
    negative = _trace({"ph": "C", "pid": 1, "name": "allocated", "ts": 0, "args": {"bytes": -1}})
    assert any("negative" in p for p in validate_chrome_trace(negative))
    backwards = _trace({"ph": "i", "pid": 1, "name": "x", "ts": 5, "s": "p"},
                       {"ph": "i", "pid": 1, "name": "y", "ts": 4, "s": "p"})
    assert any("before the previous" in p for p in validate_chrome_trace(backwards))
    assert validate_chrome_trace([1, 2]) != []


def test_a_gz_name_writes_the_trace_gzipped(cap: memprof.Capture, tmp_path: Path) -> None:
    import gzip

    from ..conftest import invoke_memprof

    cap.save(tmp_path / "c.memprof")
    for name in ("t.json", "t.json.gz"):
        res = invoke_memprof("export", "c.memprof", "-o", name, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
    plain = (tmp_path / "t.json").read_bytes()
    packed = (tmp_path / "t.json.gz").read_bytes()
    assert packed[:2] == b"\x1f\x8b" and gzip.decompress(packed) == plain and len(packed) < len(plain) / 3
    assert validate_chrome_trace(json.loads(gzip.decompress(packed))) == []


def test_slices_can_be_left_out(cap: memprof.Capture) -> None:
    full = json.loads(render("chrome", cap))
    some = chrome_trace(cap, slices="graphs")  # an eager run: no compiled-graph call, so no slice
    bare = chrome_trace(cap, slices="none")
    for trace in (some, bare):
        assert validate_chrome_trace(trace) == []
        assert not [e for e in trace["traceEvents"] if e["ph"] == "X"]
        # the counters and markers stay: the peak to the byte
        peaks = [e for e in trace["traceEvents"] if e.get("cat") == "peak"]
        assert peaks[0]["args"]["bytes"] == cap.peak("cpu")
    assert [e for e in full["traceEvents"] if e["ph"] == "X" and e["cat"] == "op"]


def test_graph_slices_keep_compiled_calls_and_their_kernels() -> None:
    compiled = memprof.load(Path(__file__).resolve().parent.parent / "fixtures" / "gpt2_bf16_cpu.memprof")
    xs = [e for e in chrome_trace(compiled, slices="graphs")["traceEvents"] if e["ph"] == "X"]
    full = [e for e in chrome_trace(compiled)["traceEvents"] if e["ph"] == "X"]
    assert any(e["cat"] == "compiled_graph" for e in xs) and len(xs) < len(full)
    # what is left besides graph calls and kernels are extern ops run inside a graph call, with their FX nodes
    assert all(e["cat"] in ("compiled_graph", "kernel") or "fx_nodes" in e.get("args", {}) for e in xs)


def test_steps_a_to_b_hold_those_steps_and_open_at_their_start(cap: memprof.Capture, tmp_path: Path) -> None:
    from ..conftest import invoke_memprof, one_line_error

    steps = {s.step: s for s in cap.steps("cpu")}
    trace = chrome_trace(cap, steps=(2, 3))
    assert validate_chrome_trace(trace) == [] and trace["otherData"]["steps"] == [2, 3]
    evs = trace["traceEvents"]
    t0 = cap.info.t_start_ns
    lo, hi = (steps[2].t_start_ns - t0) / 1000, (steps[3].t_end_ns - t0) / 1000
    assert [e["name"] for e in evs if e.get("cat") == "step"] == ["step 2", "step 3"]
    counters = [e for e in evs if e["ph"] == "C" and e["name"] == "allocated"]
    assert all(lo - 1e-3 <= e["ts"] <= hi + 1e-3 for e in counters)
    tl = cap.timeline("cpu")
    # the first point is what was live where step 2 began; the highest is the two steps' peak
    assert counters[0]["args"]["bytes"] == tl.allocated_before_row(steps[2].start_row)
    assert max(e["args"]["bytes"] for e in counters) == max(steps[2].peak, steps[3].peak)
    peak = [e for e in evs if e.get("cat") == "peak"]
    assert len(peak) == 1 and peak[0]["name"].startswith("steps 2:3 peak")
    by_cat = [e for e in evs if e["ph"] == "C" and e["name"] == "by category"]
    assert sum(by_cat[0]["args"].values()) == counters[0]["args"]["bytes"]
    slices = [e for e in evs if e["ph"] == "X"]
    assert slices and all(e["ts"] <= hi + 1e-3 and e["ts"] + e["dur"] >= lo - 1e-3 for e in slices)
    whole = [e for e in chrome_trace(cap)["traceEvents"] if e["ph"] == "X"]
    assert len(slices) < len(whole)
    cap.save(tmp_path / "c.memprof")
    res = invoke_memprof("export", "c.memprof", "--steps", "2:9", cwd=tmp_path)
    assert res.returncode != 0 and one_line_error(res) == "memprof: error: --steps 2:9: this capture has steps 1 to 3"
    res = invoke_memprof("export", "c.memprof", "--format", "html", "--steps", "1:2", cwd=tmp_path)
    assert res.returncode != 0 and one_line_error(res) == "memprof: error: --steps does not apply to --format html"
    assert not list(tmp_path.glob("c.html")) and not list(tmp_path.glob("c.json"))


def test_every_reporter_takes_typed_options_and_writes_to_a_file_object(cap: memprof.Capture) -> None:
    import dataclasses
    import io

    from memprof.reporters import reporters

    for name, reporter in reporters().items():
        assert dataclasses.is_dataclass(reporter.options), name
        opts = reporter.options()  # every option has a default
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(opts, dataclasses.fields(opts)[0].name, None)
        out = io.BytesIO() if reporter.binary else io.StringIO()
        reporter.write(cap, opts, out)
        assert out.getvalue(), name
    assert render("text", cap) == render("text", cap, top=8)


def test_times_are_written_to_the_nanosecond() -> None:
    """The slices' and counters' times are formatted from integer nanoseconds: the same numbers as
    the floats they stand for, negative ones (a time before the window's start, shifted) included."""
    import numpy as np

    from memprof.reporters.chrome_events import us_text

    us = np.asarray([0.0, 1.5, 12.345, 999.9995, -0.001, -3.25, 1e9 + 0.002])
    text = us_text(us)
    assert text == ["0.000", "1.500", "12.345", "1000.000", "-0.001", "-3.250", "1000000000.002"]
    assert [json.loads(t) for t in text] == [0.0, 1.5, 12.345, 1000.0, -0.001, -3.25, 1e9 + 0.002]
