"""memory_viz snapshots both ways: a capture exported as the pickle `_dump_snapshot` writes (torch's
own `_memory_viz` reads it), snapshots read back as captures with the same peak and live set, one
torch made, and hostile or oversized files refused in one line with nothing run."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import memprof
from memprof.errors import CaptureFileError

from ..conftest import invoke_memprof, one_line_error

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _export(capture: Path, out: Path) -> dict[str, Any]:
    res = invoke_memprof("export", str(capture), "--format", "snapshot", "-o", str(out), cwd=out.parent)
    assert res.returncode == 0, res.stderr
    raw = out.read_bytes()
    assert raw[:2] == b"\x80\x04"  # protocol 4: memory_viz's unpickler leaves protocol 5 blank
    data = pickle.loads(raw)
    assert isinstance(data, dict)
    return data


@pytest.mark.parametrize("fixture", ["gpt2_bf16_cpu.memprof", "tiny_compiled_cuda.memprof"])
def test_a_capture_round_trips_through_a_snapshot(fixture: str, tmp_path: Path) -> None:
    original = memprof.load(FIXTURES / fixture)
    device = original.main_device
    data = _export(FIXTURES / fixture, tmp_path / "s.pickle")
    entries = [e for t in data["device_traces"] for e in t]
    assert {e["action"] for e in entries} <= {"alloc", "free_requested", "free_completed"}
    assert "unknown" in {e["category"] for e in entries}  # the viewer throws without it
    cats = {e["category"] for e in entries if e["action"] == "alloc"}
    assert cats <= {*memprof.analysis.labels.CATEGORIES, "unknown"} and "gradient" in cats
    assert any(f.get("fx_node_name", "").startswith(("fw0:", "bw0:")) for e in entries for f in e["frames"])
    for seg in data["segments"]:  # the blocks tile their segment
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    back = memprof.load(tmp_path / "s.pickle")
    assert back.devices == [device] if device == "cpu" else device in back.devices
    assert back.peak(device) == original.peak(device)
    assert sum(a.bytes for a in back.live_at_peak(device)) == sum(a.bytes for a in original.live_at_peak(device))
    by_cat = {r.key: r.bytes for r in original.attribution(device=device)}
    assert {r.key: r.bytes for r in back.attribution(device=device)} == by_cat
    # torch's own reader takes it (its HTML and flame graph views fetch code from the network)
    from torch.cuda import _memory_viz

    assert "segments: 1" in _memory_viz.segsum(data) and _memory_viz.trace(data).startswith("Device")
    report = invoke_memprof("report", str(tmp_path / "s.pickle"), cwd=tmp_path)
    assert report.returncode == 0 and "read from a memory snapshot" in report.stdout


def _profiler_snapshot() -> tuple[dict[str, Any], int]:
    """A snapshot torch makes (torch.profiler's memory profile, `_profile_to_snapshot`), and its
    peak replayed from its own trace."""
    from torch.cuda._memory_viz import _profile_to_snapshot

    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
    x = torch.randn(64, 128)
    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        model(x).sum().backward()
    snap = _profile_to_snapshot(prof)
    level, peak = 0, 0
    for e in snap["device_traces"][-1]:
        level += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        peak = max(peak, level)
    return snap, peak


@pytest.mark.parametrize("protocol", [4, 5])
def test_a_snapshot_torch_made_reads_at_either_protocol(protocol: int, tmp_path: Path) -> None:
    snap, replayed = _profiler_snapshot()
    path = tmp_path / "prof.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=protocol))
    cap = memprof.load(path)
    (device,) = cap.devices
    # blocks live before its trace began count from the start; the trace's own rise is exact
    tl = cap.timeline(device)
    assert tl.peak - tl.baseline == replayed > 0
    cats = {r.key for r in cap.attribution(device=device) if r.bytes}
    assert cats & {"parameter", "gradient", "saved_activation", "temporary"}


class _Payload:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.target}",))


def test_a_pickle_with_code_runs_nothing_and_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"device_traces": [], "segments": [], "x": _Payload(target)}, protocol=4))
    line = one_line_error(invoke_memprof("report", str(evil), cwd=tmp_path))
    assert "not a memory snapshot: it names posix.system" in line or "names os.system" in line
    assert not target.exists()
    with pytest.raises(CaptureFileError):
        memprof.load(evil)
    assert not target.exists()


def test_bad_and_oversized_snapshots_are_one_line(tmp_path: Path) -> None:
    cases = {
        "list.pickle": (pickle.dumps([1, 2, 3], protocol=4), "a list, not a dict"),
        "nodict.pickle": (pickle.dumps({"segments": []}, protocol=4), "no device_traces list"),
        "badentry.pickle": (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": -1}]]},
                                         protocol=4), "not a whole number"),
        "huge.pickle": (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1,
                                                                           "size": 1 << 60}]]}, protocol=4),
                        "not a whole number in range"),
        "badblock.pickle": (pickle.dumps({"device_traces": [[]], "segments": [{"blocks": [{"size": "abc"}]}]},
                                         protocol=4), "a block whose size or address"),
        "cut.pickle": (pickle.dumps({"segments": [], "device_traces": []}, protocol=4)[:-5], "not a readable pickle"),
    }
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        assert words in one_line_error(invoke_memprof("report", name, cwd=tmp_path)), name
    # 1 GB (sparse on disk): refused by the size cap before a byte of it is unpickled
    big = tmp_path / "big.pickle"
    with open(big, "wb") as fh:
        fh.write(b"\x80\x04")
        fh.truncate(10**9)
    assert "over memprof's 512 MB cap for snapshots (set MEMPROF_MAX_SNAPSHOT_MB" in one_line_error(
        invoke_memprof("report", str(big), cwd=tmp_path))
    small = tmp_path / "list.pickle"
    assert "cap for snapshots" in one_line_error(
        invoke_memprof("report", str(small), cwd=tmp_path, env={"MEMPROF_MAX_SNAPSHOT_MB": "0.000001"}))
    assert "--max-counter-points does not apply to --format snapshot" in one_line_error(invoke_memprof(
        "export", str(FIXTURES / "tiny_compiled.memprof"), "--format", "snapshot", "-o", str(tmp_path / "o.pickle"),
        "--max-counter-points", "100", cwd=tmp_path))


def test_a_real_dump_snapshot_reads_to_the_allocators_bytes(tmp_path: Path) -> None:
    """`torch.cuda.memory._dump_snapshot` of a compiled MLP's three AdamW steps on the H200
    (tools/make_fixtures.py --snapshot), history on from before the model was made: its entries hold
    requests, and read as the allocator's 512-byte blocks they give what PyTorch reported."""
    import json

    path = FIXTURES / "tiny_snapshot_cuda.pickle"
    expected = json.loads(path.with_suffix(".json").read_text())
    assert path.read_bytes()[:2] in (b"\x80\x04", b"\x80\x05") and path.stat().st_size < 1_000_000
    cap = memprof.load(path)
    assert cap.devices == ["cuda:0"] and cap.exact
    tl = cap.timeline("cuda:0")
    assert cap.peak("cuda:0") == expected["max_memory_allocated"]
    assert tl.final == expected["memory_allocated"]
    assert sum(r.bytes for r in cap.attribution(device="cuda:0")) == cap.peak("cuda:0")
    res = invoke_memprof("report", str(path), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["devices"][0]["peak_bytes"] == expected["max_memory_allocated"]
    # and back out as memprof's own snapshot: the same peak
    out = tmp_path / "again.pickle"
    assert invoke_memprof("export", str(path), "--format", "snapshot", "-o", str(out), cwd=tmp_path).returncode == 0
    assert memprof.load(out).peak("cuda:0") == expected["max_memory_allocated"]
