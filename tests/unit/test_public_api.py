"""Every name the README's Python API section shows still works (on a committed capture)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import memprof
import memprof.remat

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_compiled.memprof"


def test_the_readme_api(tmp_path: Path) -> None:
    cap = memprof.load(FIXTURE)
    dev = cap.main_device
    assert cap.exact and cap.caveats == [] and cap.peak(dev) == cap.peak(lower_bound=True)
    assert cap.peak(dev, step=2) == next(s.peak for s in cap.steps(dev) if s.step == 2)
    live = cap.live_at_peak(dev)
    assert live and live[0].bytes >= live[-1].bytes and live[0].scope is not None
    assert isinstance(cap.scope_stack_at_peak(dev), list)
    tl = cap.timeline(dev)
    assert tl.peak == cap.peak(dev) and len(tl.t_ns) == len(tl.allocated) == len(tl.delta)
    assert set(cap.events.dtype.names or ()) >= {"t_ns", "seq", "kind", "bytes", "device", "scope"}
    rows = cap.attribution(at="peak", by="node")
    assert sum(r.bytes for r in rows) == cap.peak(dev) and {"key", "bytes", "count", "share", "category"} <= set(
        type(rows[0]).__dataclass_fields__)
    plan = cap.plans[0]
    assert isinstance(plan.saved, list) and isinstance(plan.recomputed, list) and plan.recomputed_random == []
    assert cap.graphs and cap.graphs[0].role in ("forward", "backward", "inference") and cap.graphs[0].source
    assert isinstance(cap.info, memprof.CaptureInfo) and cap.info.steps == 3
    again = memprof.load(cap.save(tmp_path / "again.memprof"))
    assert again.peak(dev) == cap.peak(dev)
    assert isinstance(rows[0], memprof.AttributionRow) and isinstance(cap.steps(dev)[0], memprof.StepStat)
    assert isinstance(live[0], memprof.LiveAllocation) and isinstance(tl, memprof.Timeline)
    assert isinstance(cap.labels(dev).category, np.ndarray)
    assert issubclass(memprof.IncompleteCaptureError, memprof.MemprofError)


def test_capture_step_and_active_record_what_the_readme_says() -> None:
    import torch

    assert memprof.active() is False and memprof.step() == 0  # no capture: nothing to mark
    with memprof.capture(scopes="none") as cap:
        assert memprof.active() is True
        x = torch.empty(256)
        assert memprof.step() == 1
        del x
        assert memprof.step() == 2
    assert memprof.active() is False
    assert [(s.step, s.peak) for s in cap.steps("cpu")] == [(1, 1024), (2, 1024)]


def test_the_remat_names_do_what_they_say() -> None:
    import torch

    assert memprof.remat.MODES == ("light", "all")
    assert memprof.remat.active_mode() is None
    with memprof.remat.enable("light"):
        assert memprof.remat.active_mode() == "light"
    assert memprof.remat.active_mode() is None
    part = memprof.remat.partitioner("all")
    assert isinstance(part, torch._inductor.custom_graph_pass.CustomPartitionerFn) and part.uuid()
    assert callable(memprof.remat.partition_fn("light"))
    assert isinstance(memprof.remat.reports(), list)
    with pytest.raises(ValueError, match="unknown remat mode"):
        memprof.remat.partitioner("heavy")


def test_a_gpu_nothing_was_allocated_on_is_not_the_main_device() -> None:
    """The CUDA tracker adds an empty baseline for each GPU when CUDA initializes; a CPU model traced
    on a GPU machine is still reported, and attributed, on the CPU."""
    cap = memprof.load(FIXTURE)
    assert cap.main_device == "cpu"
    meta = dict(cap.meta, baselines={**cap.meta["baselines"], "cuda:0": {"allocated": 0, "reserved": 0}})
    on_gpu_machine = memprof.Capture(raw=cap.raw, strings=cap.strings, meta=meta, plans=cap.plans, graphs=cap.graphs,
                                     tensors=cap.tensors)
    assert on_gpu_machine.devices == ["cpu"] and on_gpu_machine.main_device == "cpu"
    assert [c.level for c in on_gpu_machine.labels().calls] == [c.level for c in cap.labels().calls]
    meta["baselines"]["cuda:0"] = {"allocated": 512, "reserved": 2 << 20}  # bytes there at the start: in use
    assert memprof.Capture(raw=cap.raw, strings=cap.strings, meta=meta).devices == ["cpu", "cuda:0"]
