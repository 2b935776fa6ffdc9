"""The model of PyTorch's CUDA caching allocator (`memprof.analysis.caching_allocator`): its rules on
hand-made requests, and a replay of a real CUDA capture that must give every block and segment the
capture recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import memprof
from memprof._events import Kind
from memprof.analysis.caching_allocator import (
    CachingAllocatorModel,
    OptimizerStep,
    model_at,
    model_from_segments,
    round_size,
    segment_size,
    settings_modelled,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MiB = 1 << 20


def test_requests_round_to_512_bytes_and_segments_follow_the_request_size() -> None:
    assert [round_size(n) for n in (1, 512, 513, 3 * MiB - 1)] == [512, 512, 1024, 3 * MiB]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # the small pool's 2 MiB segments
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB


def test_a_block_is_split_only_when_more_than_1_mib_would_remain() -> None:
    m = CachingAllocatorModel()
    assert m.malloc(1, 3 * MiB) == 3 * MiB  # from a new 20 MiB segment, split: 17 MiB stay free
    assert m.reserved == 20 * MiB and m.segments == 1
    assert m.malloc(2, 15 * MiB) == 15 * MiB  # 2 MiB would remain: split
    assert m.malloc(3, 1536 * 1024) == 2 * MiB  # the 2 MiB tail: 0.5 MiB would remain, so all of it
    m.free(1)  # the first 3 MiB are free again
    assert m.malloc(4, 2 * MiB) == 3 * MiB  # 1 MiB would remain: the whole block, as torch counts it
    assert m.allocated == 20 * MiB == m.peak_allocated and m.segments == 1


def test_small_requests_pack_2_mib_segments_and_frees_merge_neighbours() -> None:
    m = CachingAllocatorModel()
    for key in range(4):
        assert m.malloc(key, 512 * 1024) == 512 * 1024
    assert m.segments == 1 and m.reserved == 2 * MiB
    m.free(1)
    m.free(2)  # merged with 1: one free 1 MiB block
    assert m.malloc(9, MiB) == MiB and m.segments == 1
    assert m.malloc(10, 1) == 512 and m.segments == 2  # nothing free: a new segment
    assert m.free(99) == 0  # a key never allocated


def test_a_copy_replays_independently() -> None:
    m = CachingAllocatorModel()
    m.malloc(1, 5 * MiB)
    requests = [(2, 2 * MiB), (3, 7 * MiB), (2, 0), (4, 2 * MiB)]
    assert m.copy().run(requests) == m.copy().run(requests) == 9 * MiB
    assert m.allocated == 5 * MiB and m.block_of(1) == 5 * MiB and m.block_of(2) == 0


@pytest.mark.parametrize(("conf", "modelled"), [
    ("", True), ("expandable_segments:False", True), ("garbage_collection_threshold:0.6", True),
    ("expandable_segments:True", False), ("max_split_size_mb:128", False),
    ("roundup_power2_divisions:4", False), ("backend:cudaMallocAsync", False),
])
def test_allocator_settings_the_model_holds_for(conf: str, modelled: bool) -> None:
    assert settings_modelled(conf) is modelled


def test_replaying_a_cuda_capture_gives_every_block_and_segment_it_recorded() -> None:
    """A CUDA capture from the process's start (the GQA decoder, 2 layers at full width, bf16, H200):
    the model fed its requests in order gives each the block the capture recorded (`model_at`
    returns None at the first disagreement), ends with the capture's live bytes, and reserves what
    its segment events add up to."""
    cap = memprof.load(FIXTURES / "gqa_blocks_cuda.memprof")
    tl = cap.timeline("cuda:0")
    raw = cap.raw
    large = raw["bytes"][(raw["kind"] == Kind.ALLOC) & (raw["device_type"] == 1)] > raw["aux"][
        (raw["kind"] == Kind.ALLOC) & (raw["device_type"] == 1)] + 512
    assert large.any()  # blocks the allocator did not split are in it
    model = model_at(raw, tl, len(tl.rows) - 1)
    assert model is not None
    assert model.allocated == int(tl.allocated[-1])
    segments = raw["bytes"][(raw["kind"] == Kind.SEGMENT_ALLOC) & (raw["device_type"] == 1)]
    assert model.reserved == int(segments.sum())
    # a wrong block size recorded anywhere: the replay refuses rather than guess
    bad = raw.records()
    first = int(np.flatnonzero((bad["kind"] == Kind.ALLOC) & (bad["device_type"] == 1))[-1])
    bad["bytes"][first] += 512
    assert model_at(bad, tl, len(tl.rows) - 1) is None


def test_no_model_for_the_cpu_or_a_capture_that_began_mid_run() -> None:
    cap = memprof.load(FIXTURES / "tiny_compiled.memprof")
    tl = cap.timeline("cpu")
    assert model_at(cap.raw, tl, len(tl.rows) - 1) is None
    cap = memprof.load(FIXTURES / "tiny_compiled_cuda.memprof")  # its model was made before the capture
    tl = cap.timeline("cuda:0")
    assert tl.baseline > 0 and model_at(cap.raw, tl, len(tl.rows) - 1) is None


def test_no_model_under_allocator_settings_it_does_not_hold_for() -> None:
    cap = memprof.load(FIXTURES / "gqa_blocks_cuda.memprof")
    tl = cap.timeline("cuda:0")
    assert model_at(cap.raw, tl, 100, "garbage_collection_threshold:0.8") is not None
    assert model_at(cap.raw, tl, 100, "max_split_size_mb:64") is None
    assert model_at(cap.raw, tl, 100, limit=100) is None  # a long capture: not replayed past the limit


def test_a_snapshots_segments_give_the_allocators_state() -> None:
    """`torch.cuda.memory._snapshot()`'s segments (what a prediction sees before its first step): a
    large segment with a block in use between two free ones, and a small segment."""
    segments = [
        {"device": 0, "address": 1 << 30, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
         "blocks": [{"size": 3 * MiB, "state": "inactive"}, {"size": 5 * MiB, "state": "active_allocated"},
                    {"size": 12 * MiB, "state": "inactive"}]},
        {"device": 0, "address": 1 << 31, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
         "blocks": [{"size": 512, "state": "active_pending_free"}, {"size": 2 * MiB - 512, "state": "inactive"}]},
        {"device": 1, "address": 1 << 32, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
         "blocks": [{"size": 2 * MiB, "state": "inactive"}]},
    ]
    m = model_from_segments(segments, 0)
    assert (m.allocated, m.reserved, m.segments) == (5 * MiB + 512, 22 * MiB, 2)
    assert m.malloc(1, 2 * MiB) == 3 * MiB  # the free 3 MiB block before the one in use: all of it
    assert m.malloc(2, 512) == 512 and m.segments == 2  # the small segment's free tail
    m.free(1)
    assert m.malloc(3, 14 * MiB) == 14 * MiB and m.segments == 3  # the 3 and 12 MiB are not adjacent


def test_adams_step_temporaries_follow_torchs_order() -> None:
    """What a parameter group's step allocates and frees beside its state: foreach (CUDA's default)
    makes `_foreach_sqrt` of every exp_avg_sq at once, per dtype, each dtype's live until the next
    one's are made; coupled weight decay first copies the gradients (deleted before the square
    roots); one tensor at a time holds a square root and a denominator; fused, nothing."""
    from memprof.torch_hooks.optimizer_step import adam_temporaries

    f32, bf16 = "float32", "bfloat16"
    assert adam_temporaries({}, [(f32, 10), (f32, 20)], True) == [(0, 10), (1, 20), (0, 0), (1, 0)]
    assert adam_temporaries({"fused": True}, [(f32, 10)], True) == []
    assert adam_temporaries({"weight_decay": 0.1}, [(f32, 10)], False, key=5) == [(5, 10), (5, 0), (6, 10), (6, 0)]
    assert adam_temporaries({"weight_decay": 0.1}, [(f32, 10)], True) == [(0, 10), (0, 0)]  # AdamW: in place
    assert adam_temporaries({}, [(f32, 10), (bf16, 4)], True) == [(0, 10), (1, 4), (0, 0), (1, 0)]
    assert adam_temporaries({"capturable": True}, [(f32, 10)], True) == [(0, 4), (1, 4), (2, 10), (0, 0), (1, 0),
                                                                          (2, 0)]
    assert adam_temporaries({"foreach": False}, [(f32, 10), (f32, 20)], True) == [
        (0, 10), (1, 10), (0, 0), (2, 20), (3, 20), (2, 0), (1, 0), (3, 0)]


def test_the_optimizers_temporaries_reserve_what_the_free_blocks_cannot_serve() -> None:
    """After the first step the gradients are live and the step's activations free (large blocks):
    foreach Adam's square roots of small parameters come from the small pool, new 2 MiB segments
    the steps after keep reserved (a paper Llama capture's first AdamW step made 54 of them, in
    `_foreach_sqrt`); they change neither what the next step starts from nor its peak."""
    from memprof.analysis.caching_allocator import steady_peak

    step = [[(1, 8 * MiB), (2, 4 * MiB), (3, 512 * 1024), (1, 0)]]  # an activation freed, a gradient kept
    state = [512 * 1024, 512 * 1024]
    plain = steady_peak(CachingAllocatorModel(), step, OptimizerStep(state))
    sqrt = [(k, 256 * 1024) for k in range(16)] + [(k, 0) for k in range(16)]  # 4 MiB of small temporaries
    with_temps = steady_peak(CachingAllocatorModel(), step, OptimizerStep(state, sqrt))
    assert (with_temps.start, with_temps.peak) == (plain.start, plain.peak)
    assert with_temps.reserved - plain.reserved == 4 * MiB


def test_an_optimizer_step_above_the_steps_own_peak_is_the_peak() -> None:
    """With little kept for the backward (the remat pass at a low budget), the optimizer step, the
    gradients live beside its temporaries, can hold more than the forward and backward: the peak a
    prediction gives is then the optimizer step's, with the allocator's blocks or in requests (the
    CPU). On the CPU torch's Adam runs one tensor at a time by default (CUDA: foreach)."""
    import torch

    from memprof.analysis.caching_allocator import optimizer_peak, steady_peak
    from memprof.torch_hooks.optimizer_step import optimizer_state_requests

    step = [[(1, 1 * MiB), (2, 4 * MiB), (1, 0)]]  # an activation freed, a 4 MiB gradient kept
    sqrt = [(k, 2 * MiB) for k in range(2)] + [(k, 0) for k in range(2)]
    between = OptimizerStep([4 * MiB, 4 * MiB], sqrt, grads=4 * MiB)
    assert optimizer_peak(between) == 8 * MiB
    assert steady_peak(CachingAllocatorModel(), step, between).peak == 8 * MiB
    assert steady_peak(CachingAllocatorModel(), step, OptimizerStep([4 * MiB, 4 * MiB])).peak == 5 * MiB
    before, _ = optimizer_state_requests(-1)  # (optimizers other tests left alive, if any)
    w = torch.nn.Parameter(torch.zeros(1000))
    opt = torch.optim.AdamW([w])
    found, unknown = optimizer_state_requests(-1)
    assert not unknown and found.state[len(before.state):] == [4000, 4000] and found.grads - before.grads == 4000
    # one tensor at a time: its square root and the denominator
    assert [b for _k, b in found.transient[len(before.transient):]] == [4000, 4000, 0, 0]
    del opt


def _gqa_prediction_inputs(cap: Any) -> tuple[CachingAllocatorModel, list[int]]:
    """What a prediction of the GQA fixture's steps starts from (`memprof.sweep.replay`)."""
    from memprof.sweep.replay import prediction_inputs

    found = prediction_inputs(cap, "cuda:0")
    assert found is not None
    return found


def _gqa_first_calls() -> Any:
    """What the GQA fixture's first step made beyond a later step's (`FirstCalls`): the kernels
    that autotuned (tools/make_fixtures.py --autotune: read from their heuristics with Triton, an
    empty Inductor cache, as the run had), the H200's 60 MiB L2 flush and the 32 MiB cuBLAS workspace
    of each thread (checked against the run's requests)."""
    import json

    from memprof.sweep.block_peak import FirstCalls

    tuned = json.loads((FIXTURES / "gqa_blocks_cuda.autotune.json").read_text())["autotuned"]
    return FirstCalls({(int(k.split(":")[0]), k.split(":")[1]): frozenset(v) for k, v in tuned.items()},
                          60 * MiB, 32 * MiB)


def test_a_prediction_counts_blocks_from_the_state_before_the_first_step() -> None:
    """A prediction has the allocator only as it was before the first step (no step ran): the step's
    requests run twice from there, with the optimizer's first-step state (AdamW: step, exp_avg,
    exp_avg_sq per parameter) allocated between, and the second step's peak counts blocks. The first
    step's graph calls also autotune their kernels (an L2-sized flush before each benchmark) and make
    cuBLAS's workspaces; the second step finds the blocks they left. On the GQA fixture: 0.24% under
    the measured step peak (0.24% over without the first calls), where the requests alone are 0.96%
    under; the reserved bytes exact."""
    from memprof.sweep.measure import measure
    from memprof.sweep.step_estimate import estimate_capture_plans

    cap = memprof.load(FIXTURES / "gqa_blocks_cuda.memprof")
    tl = cap.timeline("cuda:0")
    before, state = _gqa_prediction_inputs(cap)
    assert len(state) == 63  # 21 parameters
    plain = estimate_capture_plans(cap.plans, cap.graphs, "cuda:0", torch_version="2.11.0", allocator=before,
                                   between=OptimizerStep(state))  # (fused AdamW: no temporaries)
    est = estimate_capture_plans(cap.plans, cap.graphs, "cuda:0", torch_version="2.11.0", allocator=before,
                                 between=OptimizerStep(state), first_calls=_gqa_first_calls())
    m = measure(cap, attribution=False)
    assert plain is not None and est is not None and m.step_peak == 436_756_992
    assert plain.peak == 437_805_568 and est.peak == 435_708_416
    assert est.requested_peak == plain.requested_peak == 432_562_688 and est.blocks
    assert not plain.workspaces_in_blocks and est.workspaces_in_blocks
    # what the second step starts from, in the model's blocks: the state tensors (some served whole
    # from larger free blocks) and the two workspaces, 512 B under the level its steps rose from
    assert m.resident is not None and est.steady_start is not None
    assert est.steady_start == before.allocated + sum(round_size(n) for n in state) + 64 * MiB + 13 * MiB // 2
    assert est.steady_start - m.resident == -512
    # the reserved bytes at the end of that step, in the model's segments: what the run reserved
    assert tl.reserved_peak == 1_841_299_456 and est.steady_reserved == tl.reserved_peak
    # without the first calls: 56 MiB under, a segment per workspace added beside the model's
    assert plain.steady_reserved is not None and plain.steady_reserved + 64 * MiB - tl.reserved_peak == -56 * MiB


def test_the_first_calls_autotuning_flushes_and_workspaces_make_the_runs_segments() -> None:
    """Why the prediction without its first calls reserves 56 MiB less than the run: in its first step
    the run autotuned 22 Triton kernels, and Inductor's benchmarker allocates an L2-cache-sized buffer
    (60 MiB on the H200) to flush the cache before each timing, freed at once (59 of them); and each
    thread's first matrix multiply made a 32 MiB cuBLAS workspace, which found a flush's free block.
    Without them the model makes six 20 MiB segments where the run made four of 60 MiB; with them,
    every segment of the run."""
    from collections import Counter

    from memprof.sweep.step_estimate import estimate_capture_plans

    cap = memprof.load(FIXTURES / "gqa_blocks_cuda.memprof")
    tl, raw = cap.timeline("cuda:0"), cap.raw
    cuda = raw["device_type"] == 1
    steps = np.flatnonzero(raw["kind"] == Kind.STEP)
    for size, count in ((60 * MiB, 59), (32 * MiB, 2)):  # the flushes and the workspaces: all in the first step
        rows = np.flatnonzero(cuda & (raw["kind"] == Kind.ALLOC) & (raw["aux"] == size))
        assert len(rows) == count and (rows < steps[0]).all()
        at = np.searchsorted(tl.rows, rows)
        if size == 60 * MiB:  # each freed within the first step
            assert (tl.free_of[at] >= 0).all() and (tl.rows[tl.free_of[at]] < steps[0]).all()
    real = Counter((raw["bytes"][cuda & (raw["kind"] == Kind.SEGMENT_ALLOC)] // MiB).tolist())

    made: list[int] = []

    class Counting(CachingAllocatorModel):
        def _segment(self, small: bool, stream: int, size: int) -> Any:
            made.append(size // MiB)
            return super()._segment(small, stream, size)

    before, state = _gqa_prediction_inputs(cap)
    before.__class__ = Counting  # (its copies count the segments they make)
    first_scope = int(np.flatnonzero(raw["kind"] == Kind.SCOPE_BEGIN)[0])
    early = cuda & (raw["kind"] == Kind.SEGMENT_ALLOC) & (np.arange(len(raw)) < first_scope)
    before_segments = Counter((raw["bytes"][early] // MiB).tolist())
    models = []
    for first_calls in (None, _gqa_first_calls()):
        made.clear()
        estimate_capture_plans(cap.plans, cap.graphs, "cuda:0", torch_version="2.11.0", allocator=before,
                               between=OptimizerStep(state), first_calls=first_calls)
        models.append(before_segments + Counter(made))
    assert real - models[0] == Counter({60: 4}) and models[0] - real == Counter({20: 6})
    assert models[1] == real


_TUNED_WRAPPER = '''
def call(args):
    arg0_1, = args
    args.clear()
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf0 = empty_strided_cuda((1024, ), (1, ), torch.float32)
        stream0 = get_raw_stream(0)
        triton_red_fused_0.run(arg0_1, buf0, 1024, stream=stream0)
        buf1 = empty_strided_cuda((1024, ), (1, ), torch.float32)
        triton_poi_fused_1.run(buf0, buf1, 1024, stream=stream0)
        del buf0
        buf2 = empty_strided_cuda((1024, ), (1, ), torch.float32)
        triton_red_fused_0.run(buf1, buf2, 1024, stream=stream0)
        del buf1
    return (buf2, )
'''


def test_a_first_call_flushes_the_cache_before_each_autotuning_kernels_first_launch() -> None:
    """The walk marks each Triton launch; a graph's first call adds Inductor's benchmark flush (an
    L2-sized buffer, made and freed) before the first launch of each kernel that autotunes, and
    before no later launch of it (its best config is chosen then)."""
    from memprof.sweep.block_peak import first_call
    from memprof.sweep.estimate import walk_wrapper

    walk = walk_wrapper(_TUNED_WRAPPER, None, block=512)
    assert [name for _, name in walk.launches] == ["triton_red_fused_0", "triton_poi_fused_1", "triton_red_fused_0"]
    assert first_call(walk, frozenset(), 60 * MiB) == (list(walk.log), False, False)
    first, _, _ = first_call(walk, frozenset({"triton_red_fused_0"}), 60 * MiB)
    flushes = [i for i, (_k, n) in enumerate(first) if n == 60 * MiB]
    assert len(first) == len(walk.log) + 2 and flushes == [1]  # after buf0 is made, before the launch
    assert first[2][1] == 0 and first[2][0] == first[1][0]  # freed at once
    model = CachingAllocatorModel()
    model.run(first)
    assert model.reserved == 60 * MiB + 2 * MiB  # its segment stays: the buffers' small blocks share a 2 MiB one


_MATMUL_WRAPPER = '''
def call(args):
    arg0_1, arg1_1, arg2_1 = args
    args.clear()
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf0 = empty_strided_cuda((64, 64), (64, 1), torch.float32)
        extern_kernels.mm(arg0_1, arg1_1, out=buf0)
        buf1 = empty_strided_cuda((64, 64), (64, 1), torch.float32)
        extern_kernels.addmm(arg2_1, buf0, arg1_1, alpha=1, beta=1, out=buf1)
        del buf0
    return (buf1, )
'''


def test_a_threads_cublaslt_workspace_is_made_at_its_first_addmm() -> None:
    """cuBLAS makes a thread's workspace at its first matrix multiply; cuBLASLt makes its own at the
    thread's first multiply that adds a bias (`addmm`), and a graph that calls none makes none (the
    paper BERT's run at budget 0 held two 32 MiB workspaces; at 1.0, where Inductor called one
    `addmm` in the forward, a 1 MiB cuBLASLt one beside them: H200, torch 2.11)."""
    from memprof.sweep.block_peak import first_call
    from memprof.sweep.estimate import walk_wrapper

    walk = walk_wrapper(_MATMUL_WRAPPER, None, block=512)
    assert [name for _, name in walk.launches] == ["extern_kernels.mm", "extern_kernels.addmm"]
    ws, lt = (-1, 32 * MiB), (-2, MiB)
    first, placed, lt_placed = first_call(walk, frozenset(), 0, ws, lt)
    assert placed and lt_placed and len(first) == len(walk.log) + 2
    assert first.index(ws) == 1 and first.index(lt) == 3  # after buf0 (before the mm), after buf1 (before the addmm)
    no_addmm = walk_wrapper(_MATMUL_WRAPPER.replace("extern_kernels.addmm(arg2_1, ", "extern_kernels.mm("), None,
                            block=512)
    first, placed, lt_placed = first_call(no_addmm, frozenset(), 0, ws, lt)
    assert placed and not lt_placed and lt not in first


def test_each_kernels_heuristic_is_read_from_the_wrapper_code() -> None:
    """Which kernels autotune is read from each Triton kernel's heuristic decorator in the wrapper
    module (evaluated where Triton is; CI has none): every kernel of the GQA fixture's forward (18)
    and backward (22) has one, and the kernels the fixture's run autotuned are among them."""
    import json

    from memprof.torch_hooks.inductor import kernel_heuristics

    cap = memprof.load(FIXTURES / "gqa_blocks_cuda.memprof")
    tuned = json.loads((FIXTURES / "gqa_blocks_cuda.autotune.json").read_text())["autotuned"]
    for g in cap.graphs:
        kernels = kernel_heuristics(str(g.source))
        assert len(kernels) == {"forward": 18, "backward": 22}[g.role]
        for kernel_source, call in kernels.values():
            assert kernel_source.lstrip().startswith("import triton") and call is not None
            assert call.startswith(("triton_heuristics.pointwise(", "triton_heuristics.reduction(",
                                    "triton_heuristics.persistent_reduction("))
        assert set(tuned[f"{g.plan}:{g.role}"]) <= set(kernels)


def test_a_prediction_is_replayed_against_the_run_that_measured_it(capsys: pytest.CaptureFixture[str]) -> None:
    """tools/replay_prediction.py sets a prediction's model of a capture's steps (from the allocator
    before the first compiled-graph call, without the autotuning flushes) beside what the run
    measured: on the GQA fixture 1 MiB over at the step (as the test above finds without the first
    calls' flushes), and 523,776 B over at the resident bytes."""
    import importlib.util

    path = FIXTURES.parents[1] / "tools" / "replay_prediction.py"
    spec = importlib.util.spec_from_file_location("replay_prediction", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(FIXTURES / "gqa_blocks_cuda.memprof")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3] == "| step peak above resident | 436,756,992 | 437,805,568 | +1,048,576 (+0.240%) |"
    assert out[-2] == "| resident | 1,139,359,744 | 1,139,883,520 | +523,776 (+0.046%) |"
    assert tool.main([str(FIXTURES / "tiny_compiled.memprof")]) == 1  # (a CPU capture: one line, exit 1)
