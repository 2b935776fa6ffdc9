"""memprof's estimate of a step in the caching allocator's blocks: the requests the wrapper walks
make (`GraphWalk.log`), in the order a training step runs them, replayed through the model of the
CUDA caching allocator (`memprof.analysis.caching_allocator`) from its state when the step began.

The walks count requests (rounded to 512 bytes); the allocator counts blocks, and hands out a whole
free block when what would remain is 1 MiB or less: on a 24-layer decoder in bf16, 48 MB of the
measured step peak were such blocks. The step's order: the forwards of a chain of pairs (a model
and the loss compiled apart), the user's outputs dropped once the loss is computed (except what a
later pair saved), then the backwards in reverse, each after its tangents: AOTAutograd allocates
them, except a tangent that is the gradient a later pair's backward returned for that output.
Tangents held to the backward's end (`kept_tangents`) are freed when it returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memprof.analysis.caching_allocator import CachingAllocatorModel
from memprof.analysis.units import round_up
from memprof.plans import Plan
from memprof.sweep.estimate import GraphWalk, StepEstimate, tangent_nodes


def _user_outputs(est: StepEstimate, plan: Plan) -> list[int]:
    """The storage ids the pair's forward returns to its caller (not saved for its backward)."""
    fw = est.fw
    if fw is None:
        return []
    saved = {s for s in fw.outputs[plan.num_fwd_outputs:] if s is not None}
    return [s for s in fw.outputs[:plan.num_fwd_outputs] if s is not None and s not in saved]


# keys of what a step's first calls make: an autotuning benchmark's cache flush (each freed before the
# next is made: one key serves), the cuBLAS workspaces of the forward's and the backward's threads,
# and their cuBLASLt workspaces
_FLUSH_KEY = -(1 << 61)
_CUBLAS_KEYS = (_FLUSH_KEY - 1, _FLUSH_KEY - 2)
_LT_KEYS = (_FLUSH_KEY - 3, _FLUSH_KEY - 4)
WORKSPACE_KEYS = (*_CUBLAS_KEYS, *_LT_KEYS)


@dataclass(frozen=True)
class FirstCalls:
    """What the first step's graph calls allocate beyond a later step's requests: before the first
    launch of each kernel that autotunes (`autotuned`: (plan index, "forward" or "backward") ->
    kernel names, `memprof.torch_hooks.inductor.autotuned_kernels`), Inductor's benchmarker makes a
    buffer of `flush_bytes` (the L2 cache) and frees it, once per config it times (the same block
    each time: counted once); at a thread's first matrix multiply cuBLAS makes its workspace
    (`workspace_bytes`, the forward's thread's and the autograd engine's; 0: not modelled), and at
    its first `addmm` (a bias added in the multiply: cuBLASLt's path) cuBLASLt makes its own
    (`lt_workspace_bytes`; a thread that calls none has none), both kept for good."""

    autotuned: Mapping[tuple[int, str], frozenset[str]]
    flush_bytes: int
    workspace_bytes: int = 0
    lt_workspace_bytes: int = 0


def first_call(walk: GraphWalk, autotuned: frozenset[str], flush_bytes: int,
               workspace: tuple[int, int] | None = None, lt: tuple[int, int] | None = None
               ) -> tuple[list[tuple[int, int]], bool, bool]:
    """A walk's requests as a graph's first call makes them (`FirstCalls`), and whether the cuBLAS
    `workspace` and the cuBLASLt one (`lt`), each (key, bytes), went in (before its first matrix
    multiply, and its first `addmm`: else it has none)."""
    out: list[tuple[int, int]] = []
    at, seen, placed, lt_placed = 0, set(), False, False
    for pos, name in walk.launches:
        if name.startswith("extern_kernels."):
            made = []
            if workspace is not None and not placed:
                made.append(workspace)
                placed = True
            if lt is not None and not lt_placed and name == "extern_kernels.addmm":
                made.append(lt)
                lt_placed = True
            if made:
                out += [*walk.log[at:pos], *made]
                at = pos
        elif name in autotuned and name not in seen and flush_bytes > 0:
            seen.add(name)
            out += [*walk.log[at:pos], (_FLUSH_KEY, flush_bytes), (_FLUSH_KEY, 0)]
            at = pos
    return out + list(walk.log[at:]), placed, lt_placed


def chain_requests(chain: Sequence[tuple[Plan, StepEstimate]], links: Sequence[Mapping[str, int]],
                   block: int, first: FirstCalls | None = None, plan_ids: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The requests of a chain of pairs run as one step. `links[j]`: pair j's forward inputs that
    an earlier pair of the chain returned, placeholder name -> that pair's index in `chain`.
    `first`: the step is the first, its graphs' first calls (`FirstCalls`; `plan_ids`: the chain's
    pairs' plan indices, its keys)."""
    none: frozenset[str] = frozenset()
    tuned = [(first.autotuned.get((i, "forward"), none), first.autotuned.get((i, "backward"), none))
             for i in plan_ids] if first else [(none, none)] * len(chain)
    flush = first.flush_bytes if first else 0
    # the cuBLAS and cuBLASLt workspaces not yet made, by thread (0: the forward's, 1: the backward's)
    pending = {t: (k, first.workspace_bytes) for t, k in enumerate(_CUBLAS_KEYS)} \
        if first and first.workspace_bytes else {}
    pending_lt = {t: (k, first.lt_workspace_bytes) for t, k in enumerate(_LT_KEYS)} \
        if first and first.lt_workspace_bytes else {}

    def requests(walk: GraphWalk, autotuned: frozenset[str], thread: int) -> list[tuple[int, int]]:
        out, placed, lt_placed = first_call(walk, autotuned, flush, pending.get(thread), pending_lt.get(thread))
        if placed:
            del pending[thread]
        if lt_placed:
            del pending_lt[thread]
        return out
    fw_part: list[tuple[int, int]] = []
    remap: dict[int, int] = {}  # a key the walks gave a tangent -> the gradient's key it really is
    given: set[int] = set()  # tangent keys a later backward's gradient provides (never allocated)
    held_by_later: set[int] = set()  # outputs a later pair saved: its backward frees them
    for j, (plan, est) in enumerate(chain):
        fw_part += requests(est.fw, tuned[j][0], 0) if est.fw is not None else ()
        placeholders = [n.name for n in plan.forward.nodes if n.op == "placeholder"]
        for name, i in links[j].items():
            earlier_plan, earlier = chain[i]
            if earlier.fw is None or name not in placeholders:
                continue
            node = plan.forward.by_name[name]
            size = round_up(int(node.bytes or 0), block)
            outs = [s for s in _user_outputs(earlier, earlier_plan) if earlier.fw.sizes.get(s) == size]
            if not outs:
                continue
            out_keys = earlier.fw.keys.get(outs[0], ())
            if name in est.bw_inputs:  # saved by this pair: its backward's key for it is the output's
                sid = est.bw_inputs[name][0]
                remap.update(zip(est.bw_input_keys.get(sid, ()), out_keys, strict=False))
                held_by_later.update(out_keys)
            # its gradient, returned by this pair's backward, is the earlier pair's tangent for it
            bw = est.bw
            pos = placeholders.index(name)
            grad = bw.outputs[pos] if bw is not None and pos < len(bw.outputs) else None
            tangents = [t for t in tangent_nodes(earlier_plan) if round_up(int(t.bytes or 0), block) == size]
            if grad is not None and bw is not None and tangents and tangents[0].name in earlier.bw_inputs:
                tsid = earlier.bw_inputs[tangents[0].name][0]
                for k_from, k_to in zip(earlier.bw_input_keys.get(tsid, ()), bw.keys.get(grad, ()), strict=False):
                    remap[k_from] = k_to
                    given.add(k_from)
    drops = [(k, 0) for plan, est in chain for s in _user_outputs(est, plan) if est.fw is not None
             for k in est.fw.keys.get(s, ()) if k not in held_by_later]
    bw_part: list[tuple[int, int]] = []
    for j in reversed(range(len(chain))):
        plan, est = chain[j]
        if est.bw is None:
            continue
        own = [(t.name, *est.bw_inputs[t.name]) for t in tangent_nodes(plan) if t.name in est.bw_inputs]
        tangent_keys = [(name, k, nbytes) for name, sid, nbytes in own for k in est.bw_input_keys.get(sid, ())]
        bw_part += [(k, nbytes) for _name, k, nbytes in tangent_keys if k not in given]
        bw_part += requests(est.bw, tuned[j][1], 1)
        bw_part += [(k, 0) for name, k, _n in tangent_keys if name in est.held_tangents]
    # a cuBLAS workspace no multiply of the chain made: made in the step all the same (the script's
    # own); a cuBLASLt one only by an `addmm`, which the script may never call
    return [(remap.get(k, k), n) for k, n in (*fw_part, *drops, *bw_part, *pending.values())]


def block_peak(model: CachingAllocatorModel, requests: Sequence[tuple[int, int]]) -> int:
    """The most bytes the caching allocator counts above its state `model` while `requests` run
    (`model` is not changed)."""
    return model.copy().run(requests)
