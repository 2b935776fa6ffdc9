"""The sweep's step peak and memprof's estimate on the zoo's bf16 GPT-2 (the committed CPU capture
`tests/fixtures/gpt2_bf16_cpu.memprof`, written by `tools/make_fixtures.py --zoo`): a loop with
fused AdamW and `zero_grad(set_to_none=True)`, whose model and loss compile as two graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

import memprof
from memprof.analysis.timeline import window_peak, window_rise
from memprof.sweep.estimate import activation_inputs, estimate_capture_plans, estimate_step, user_outputs
from memprof.sweep.measure import _windows, measure

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gpt2_bf16_cpu.memprof"


@pytest.fixture(scope="module")
def cap() -> memprof.Capture:
    return memprof.load(FIXTURE)


def test_a_step_is_measured_above_its_resident_bytes(cap: memprof.Capture) -> None:
    """zero_grad frees the last step's gradients inside the step window: the step peak is the rise
    above the lowest level before the high point, not above the window's first level."""
    tl = cap.timeline("cpu")
    windows, source = _windows(cap, "cpu")
    assert source == "markers" and len(windows) >= 4
    for start, end, _t0, _t1 in windows[1:-1]:
        rise, pos = window_rise(tl, start, end)
        p0 = tl.pos_before_row(start)
        levels = [tl.allocated_at_pos(p0), *tl.allocated[p0 + 1 : pos + 1].tolist()]
        assert rise == levels[-1] - min(levels) and levels[-1] == tl.allocated_at_pos(pos)
        peak, _ = window_peak(tl, start, end)
        assert rise > peak - tl.allocated_before_row(start)  # gradients freed first: the start is no floor
    m = measure(cap, "cpu", attribution=False)
    assert m.step_peak == 3_903_016


def test_the_estimate_follows_the_model_into_its_loss(cap: memprof.Capture) -> None:
    """transformers computes the loss apart from the model (two compiled pairs): the loss graph
    takes the logits the model returned and saves them, and the model's saved activations stay live
    through the loss's backward. Chained, memprof's estimate equals the measured step peak to the
    byte; each pair alone it is 24% low."""
    model, loss = cap.plans
    earlier = dict.fromkeys(user_outputs(model), 0)
    assert activation_inputs(model, {}) == {}
    linked = activation_inputs(loss, earlier)
    assert list(linked) == ["primals_1"] and linked["primals_1"] == (4 * 64 * 2048 * 2, 0)  # bf16 logits
    est = estimate_capture_plans(cap.plans, cap.graphs, "cpu", probe=False)
    assert est is not None and est.peak == measure(cap, "cpu", attribution=False).step_peak
    assert sum(est.at_peak.values()) == est.peak
    alone = []
    for i, plan in enumerate(cap.plans):
        fw, bw = (next(g for g in cap.graphs if g.plan == i and g.role == role) for role in ("forward", "backward"))
        alone.append(estimate_step(plan, fw.source, bw.source).peak)
    assert max(alone) < 0.8 * est.peak
