"""The sweep's step peak and memprof's estimate on the zoo's bf16 GPT-2 (the committed CPU capture
`tests/fixtures/gpt2_bf16_cpu.memprof`, written by `tools/make_fixtures.py --zoo`): a loop with
fused AdamW and `zero_grad(set_to_none=True)`, whose model and loss compile as two graphs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import memprof
from memprof.analysis.timeline import window_peak, window_rise
from memprof.plans import FxGraph, FxNode
from memprof.sweep.estimate import estimate_step, walk_wrapper
from memprof.sweep.measure import _windows, measure
from memprof.sweep.step_estimate import activation_inputs, estimate_capture_plans, tangents_held, user_outputs

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
    assert max(alone) < 0.8 * est.peak  # 2,955,776 B


WRAPPER = '''
def call(self, args):
    primals_1, primals_2, tangents_1 = args
    args.clear()
    buf0 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    extern_kernels.mm(primals_1, tangents_1, out=buf0)
    del tangents_1
    # Topologically Sorted Source Nodes: [attn], Original ATen: [aten._scaled_dot_product_flash_attention_for_cpu]
    buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf0, buf0, buf0)
    buf3 = buf2[0]
    buf4 = buf2[1]
    del buf2
    buf5 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    cpp_fused_add_1(buf3, buf5)
    del buf3
    buf6 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    cpp_fused_add_2(buf5, buf6)
    return (buf6, buf4, )
'''


def _attn(items: list[int]) -> FxNode:
    return FxNode("attn", "call_function", "aten._scaled_dot_product_flash_attention_for_cpu.default", None, None,
                  sum(items), [], "", "attn", items=items)


def test_a_tuples_items_are_freed_each_at_its_own_del() -> None:
    """A fallback op's outputs are separate tensors: the 16 KB output dies at `del buf3` while the
    256 B logsumexp lives on (returned). Held as one storage (a plan recorded without item sizes),
    the whole tuple lived to the end."""
    fx = FxGraph([_attn([16384, 256])])
    w = walk_wrapper(WRAPPER, fx, explain=True)
    # buf0, the tuple's two items, buf5; then buf6 after buf3 (16 KB) is gone
    assert w.peak == 16384 * 3 + 256 and w.end == 16384 * 3 + 256
    assert sum(b for _, b in w.at_peak) == w.peak
    whole = walk_wrapper(WRAPPER, FxGraph([dataclasses.replace(_attn([16384, 256]), items=[])]))
    assert whole.peak == 16384 * 4 + 256  # the dead output still counted under buf6
    # on CUDA each item is its own block-rounded allocation
    assert walk_wrapper(WRAPPER, fx, block=512).peak == 16384 * 3 + 512


def test_an_item_outlives_its_own_del_while_its_tuple_lives() -> None:
    """The tuple a fallback op returns holds its items: `del buf3` of an item taken out of it frees
    nothing while `buf2` lives (Python's references), and its bytes go at `del buf2`. The caching
    allocator's model replays that order (the H200's GQA capture: cuDNN attention's backward)."""
    held_first = WRAPPER.replace("""    del buf2
    buf5 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    cpp_fused_add_1(buf3, buf5)
    del buf3
    buf6 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    cpp_fused_add_2(buf5, buf6)
    return (buf6, buf4, )""", """    buf5 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    cpp_fused_add_1(buf3, buf5)
    del buf3
    buf6 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    cpp_fused_add_2(buf5, buf6)
    del buf2
    return (buf6, buf5, buf4, )""")
    assert held_first != WRAPPER
    w = walk_wrapper(held_first, FxGraph([_attn([16384, 256])]))
    # buf0, both items, buf5 and buf6: item 0 is still the tuple's when buf6 is made
    assert w.peak == 16384 * 4 + 256 and w.end == 16384 * 3 + 256
    # the allocator's requests: item 0 (16 KB, the tuple's first key) is the one free, after buf6's request
    tuple_keys = [k for k, b in w.log[1:3]]
    assert [b for _k, b in w.log[1:3]] == [16384, 256]
    assert [(k, b) for k, b in w.log if b == 0] == [(tuple_keys[0], 0)] == [w.log[-1]]


def test_tangents_are_live_through_the_whole_backward_on_torch_2_11() -> None:
    """torch 2.11 keeps a backward's tangents live until the backward returns (the H200's captures);
    torch 2.13 frees each at the wrapper's `del` (this fixture, to the byte). The walk holds them
    where the capture's torch did."""
    assert tangents_held("2.11.0+cu130") and not tangents_held("2.13.0+cpu") and not tangents_held("junk")
    fx = FxGraph([_attn([16384, 256])])
    owned = {"tangents_1": (-1, 4096)}
    freed = walk_wrapper(WRAPPER, fx, owned)
    held = walk_wrapper(WRAPPER, fx, owned, held=frozenset({"tangents_1"}))
    assert held.end == freed.end + 4096 and held.peak == freed.peak + 4096


def test_the_summary_prints_the_sweeps_figures(cap: memprof.Capture) -> None:
    """`memprof trace` and `report` print the step peak above resident and memprof's estimate, the
    figures `memprof sweep` prints as 'peak' and 'est' (the remat pass's own figure is its FX-graph
    estimate of one pair, and says so)."""
    from memprof.analysis.summary import summarize
    from memprof.reporters import render

    step = summarize(cap).step
    assert step is not None and step.device == "cpu" and step.measured == step.estimate == 3_903_016
    text = render("text", cap)
    assert "step peak above resident bytes (cpu, median over the steps after the compiling one): 3.9 MB measured; " \
           "memprof's estimate from the compiled code 3.9 MB (+0 B, +0.00%)" in text


def test_a_step_that_peaks_outside_the_compiled_graphs_says_so() -> None:
    """The tiny CUDA fixture's step peaks in its foreach AdamW (temporaries beside the gradients),
    which memprof's estimate of the compiled graphs does not cover: the summary says so rather than
    printing a 32% miss bare."""
    from memprof.analysis.summary import summarize
    from memprof.reporters import render

    tiny = memprof.load(FIXTURE.with_name("tiny_compiled_cuda.memprof"))
    step = summarize(tiny).step
    assert step is not None and step.phase == "" and step.measured == 34_816 and step.estimate == 23_552
    assert "the measured peak is outside the compiled graphs, which is all the estimate covers" \
        in render("text", tiny)


@pytest.mark.parametrize("torch_version", ["2.11.0", "2.13.0"])
def test_the_steps_requests_in_order_live_as_the_walks_count_them(cap: memprof.Capture, torch_version: str) -> None:
    """The requests the estimate replays through the caching allocator's model (the model's
    forward, the loss's, the loss's backward, the model's backward taking the logits' gradient as
    its tangent) hold, at every moment, what the walks count: every request here is under 1 MiB
    (small-pool blocks are the rounded requests), so the model's peak is the walks' peak in 512-byte
    granules, tangents held (torch 2.11) or not."""
    from memprof.analysis.caching_allocator import CachingAllocatorModel

    requests = estimate_capture_plans(cap.plans, cap.graphs, "cuda:0", probe=False, torch_version=torch_version)
    blocks = estimate_capture_plans(cap.plans, cap.graphs, "cuda:0", probe=False, torch_version=torch_version,
                                    allocator=CachingAllocatorModel())
    assert requests is not None and blocks is not None and blocks.blocks and not requests.blocks
    assert blocks.peak == blocks.requested_peak == requests.peak
    assert "unsplit blocks" not in blocks.at_peak


def test_the_estimate_counts_the_allocators_blocks_on_cuda() -> None:
    """The GQA decoder on the H200 (2 layers at full width, bf16, budget 0.05): requests of 2 to
    5.5 MiB got whole free blocks of up to 1 MiB more. Replayed from the allocator's state when the
    median step began, memprof's estimate is the measured step peak to the byte; the requests alone
    are 4.2 MB (1.0%) short. The report says which figure it prints."""
    from memprof.reporters import render

    gqa = memprof.load(FIXTURE.with_name("gqa_blocks_cuda.memprof"))
    m = measure(gqa, attribution=False)
    assert m.step_peak == 436_756_992 and m.estimates["memprof"] == m.step_peak and m.estimate_blocks
    assert m.estimate_requested == 432_562_688 and m.block_slack == m.step_peak - m.estimate_requested
    assert "memprof's estimate from the compiled code 436.8 MB (+0 B, +0.00%) in the caching allocator's blocks, " \
           "replayed from its state when the step began (the requests alone: 432.6 MB)" in render("text", gqa)
