"""memprof's estimate of a training step: the compiled pairs of a capture (or a prediction) walked
in the order they run (`memprof.sweep.estimate` walks one pair), and what is live at the peak.

A step often runs several pairs: transformers computes a causal LM's loss apart from the model (a
graph break), so the model's pair returns the logits and the loss's pair takes them. Pairs run in
the order they compiled; one whose floating input has the shape and dtype of a value an earlier
pair returned runs after it in the same step: that input is live while its forward runs and, when
saved, until its backward ends, and the earlier pairs' saved activations are live through both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memprof.analysis.caching_allocator import CachingAllocatorModel, OptimizerStep, optimizer_peak, steady_peak
from memprof.analysis.units import CUDA_BLOCK, round_up
from memprof.plans import FxNode, Plan
from memprof.sweep.block_peak import WORKSPACE_KEYS, FirstCalls, block_peak, chain_requests
from memprof.sweep.estimate import GraphWalk, StepEstimate, estimate_step

_FLOATS = ("float32", "bfloat16", "float16", "float64")  # as FxNode.dtype records them (`value_info`)


def _value_key(node: FxNode) -> tuple[tuple[int, ...], str] | None:
    if node.shape is None or node.dtype is None or node.dtype not in _FLOATS or not node.bytes:
        return None
    return tuple(node.shape), node.dtype


def user_outputs(plan: Plan) -> set[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of the floating values a pair's forward returns to its caller (not only saves)."""
    saved = set(plan.saved)
    keys = {_value_key(n) for n in plan.forward.nodes
            if n.op != "placeholder" and "output" in n.users and n.name not in saved}
    return {k for k in keys if k is not None}


def activation_inputs(plan: Plan, earlier: Mapping[tuple[tuple[int, ...], str], int]) -> dict[str, tuple[int, int]]:
    """The pair's floating inputs that match (shape and dtype) a value an earlier pair's forward
    returned (`earlier`: key -> that pair's index), placeholder name -> (bytes, that pair): the
    hidden state or logits one graph hands to the next across a graph break (a model and its loss
    compiled apart). Parameters never carry a batch's shape, so they do not match."""
    out: dict[str, tuple[int, int]] = {}
    for n in plan.forward.nodes:
        key = _value_key(n) if n.op == "placeholder" else None
        if key is not None and key in earlier:
            out[n.name] = (int(n.bytes or 0), earlier[key])
    return out


@dataclass(frozen=True)
class CaptureEstimate:
    """memprof's estimate for a capture's compiled pairs: the largest step estimate, where it is
    ("forward", "backward", or "optimizer step" on the CPU) and what is live there by category
    (`peak_breakdown`)."""

    peak: int
    phase: str
    at_peak: dict[str, int]
    # fallback calls whose scratch could not be measured, (op, why): the estimate leaves it out
    unprobed: tuple[tuple[str, str], ...] = ()
    # the peak of the requests alone (512-byte granules), and whether `peak` counts the caching
    # allocator's blocks instead (`memprof.sweep.block_peak`: given its state when the step began)
    requested_peak: int = 0
    blocks: bool = False
    # a prediction's (`between` given): the bytes the model holds when a step after the first
    # starts, the state the first step left in the blocks the allocator gave it
    steady_start: int | None = None
    # and the bytes the model has reserved when that step ends (its segments, never returned)
    steady_reserved: int | None = None
    workspaces_in_blocks: bool = False  # the first step made cuBLAS's workspaces in the model (`FirstCalls`)
    # a prediction's: bytes of the outputs the script holds beside its loss (`held_of_pair`): every
    # step after the first starts with them; and of those a backward saves, which `peak` counts
    held_outputs: int = 0
    held_saved: int = 0


def estimate_capture_plans(plans: Sequence[Plan], graphs: Sequence[object], device: str,
                           probe: bool = True, torch_version: str | None = None,
                           allocator: CachingAllocatorModel | None = None,
                           between: OptimizerStep | None = None,
                           tangents: Mapping[int, Sequence[str]] | None = None,
                           first_calls: FirstCalls | None = None,
                           held: Sequence[tuple[int, int]] = ()) -> CaptureEstimate | None:
    """memprof's estimate for a capture's compiled pairs, or None when a pair has no Inductor
    wrapper code or has symbolic sizes (a dynamic-shape graph: the walk has no sizes to add up, and
    a figure that counted them as 0 would be wrong without saying so). `probe`: measure the fallback
    kernels' scratch memory (`memprof.sweep.probe`; skipped where their device is absent or a capture
    is running: those calls are named in `unprobed`). `torch_version`: the torch the graphs ran
    under (default the running one) and `tangents` (plan index -> those a capture saw outlive the
    compiled backward's call: `kept_tangents`) decide how long tangents live.
    `allocator`: the CUDA caching allocator as it was when the step began (`caching_allocator.model_at`):
    the step's requests are replayed through it and the peak counts its blocks. `between`: where
    `allocator` is its state before the first step (a prediction: no step ran), what is allocated
    between the first step and the next (the optimizer's step, `optimizer_state_requests`): the
    peak is then the second step's, the first having left its free blocks as a running job's do;
    `first_calls`: what the first step's graph calls allocate beyond a later step's (`FirstCalls`);
    `held`: a prediction's compiled outputs the script held at its first backward (output index,
    bytes: `memprof.torch_hooks.predict.held_outputs`)."""

    from memprof.sweep.probe import probe_graph_calls, unprobed

    block = CUDA_BLOCK if device.startswith("cuda") else 1
    version, seen = torch_version or running_torch_version(), tangents or {}
    best: CaptureEstimate | None = None
    missed: dict[tuple[str, str], None] = {}  # (an ordered set)
    if any(n.size_expr for plan in plans for n in (*plan.forward.nodes, *plan.backward.nodes)):
        return None
    # pairs run in the order they compiled; a pair that takes what an earlier one returned runs after
    # it in the same step (a graph break: the model, then its loss), with the earlier pairs' saved
    # activations live through its forward and backward
    earlier: dict[tuple[tuple[int, ...], str], int] = {}
    held_after: list[int] = []
    pairs: list[tuple[Plan, StepEstimate]] = []
    links: list[dict[str, int]] = []
    held_total, held_saved, todo = 0, 0, list(held)
    for i, plan in enumerate(plans):
        fw = [g for g in graphs if getattr(g, "plan", None) == i and getattr(g, "role", "") == "forward"]
        bw = [g for g in graphs if getattr(g, "plan", None) == i and getattr(g, "role", "") == "backward"]
        if not fw:
            return None
        scratch = (probe_graph_calls(plan.forward.nodes), probe_graph_calls(plan.backward.nodes)) if probe else None
        missed.update(dict.fromkeys(unprobed([*plan.forward.nodes, *plan.backward.nodes]) if probe else ()))
        linked = activation_inputs(plan, earlier)
        before = max((held_after[j] for _b, j in linked.values()), default=0)
        est = estimate_step(plan, str(getattr(fw[0], "source", "")), str(getattr(bw[0], "source", "")) if bw else None,
                            block, explain=True, scratch=scratch, activations={n: b for n, (b, _j) in linked.items()},
                            held_tangents=kept_tangents(plan, version, seen.get(i)), key_base=(i + 1) * _KEYS_PER_PAIR)
        pairs.append((plan, est))
        links.append({n: j for n, (_b, j) in linked.items()})
        held_after.append(before + est.saved)
        total, saved = held_of_pair(plan, est, todo, block)
        held_total, held_saved = held_total + total, held_saved + saved
        for key in user_outputs(plan):
            earlier.setdefault(key, i)
        if best is None or before + est.peak > best.peak:
            graph = bw[0] if est.phase == "backward" else fw[0]
            at_peak = peak_breakdown(plan, est.walk, est.phase, getattr(graph, "origins", {}))
            if est.phase == "forward":  # the inputs an earlier graph computed, live while it runs
                at_peak["input"] = at_peak.get("input", 0) + est.fw_peak - est.walk.peak
            if before:
                at_peak["saved_activation"] = at_peak.get("saved_activation", 0) + before
            best = CaptureEstimate(before + est.peak, est.phase, at_peak)
    if best is None:
        return None
    if allocator is None and between is not None:  # (requests, no blocks: the CPU)
        opt = optimizer_peak(between)
        if opt > best.peak:  # its optimizer step holds more than its forward or backward
            best = CaptureEstimate(opt, "optimizer step", {"gradient": between.grads, "temporary": opt - between.grads})
    best = dataclasses.replace(best, unprobed=tuple(missed), requested_peak=best.peak, held_outputs=held_total,
                               held_saved=held_saved)
    if allocator is not None:
        best = _in_blocks(best, pairs, links, block, allocator, between, first_calls)
    return best


def held_of_pair(plan: Plan, est: StepEstimate, held: list[tuple[int, int]], block: int) -> tuple[int, int]:
    """Bytes of the held outputs (`held`: output index, bytes; those matched here are taken off it)
    that are this pair's forward outputs (the index, and the size of its storage), and of those its
    backward saves. The script keeps them (in a variable, until the next step's forward returns new
    ones): a step after the first starts with them, as a measured step rises from them. The walk
    frees one that is not saved when the forward returns, and holds a saved one into the backward."""
    fw = est.fw
    if fw is None:
        return 0, 0
    kept = {s for s in fw.outputs[plan.num_fwd_outputs:] if s is not None}
    total = saved = 0
    for item in list(held):
        k, nbytes = item
        sid = fw.outputs[k] if k < min(plan.num_fwd_outputs, len(fw.outputs)) else None
        if sid is not None and fw.sizes.get(sid) == round_up(nbytes, block):
            held.remove(item)
            total += fw.sizes[sid]
            saved += fw.sizes[sid] if sid in kept else 0
    return total, saved


def running_torch_version() -> str:
    import torch

    return str(torch.__version__)


def _in_blocks(best: CaptureEstimate, pairs: Sequence[tuple[Plan, StepEstimate]], links: Sequence[Mapping[str, int]],
               block: int, allocator: CachingAllocatorModel, between: OptimizerStep | None,
               facts: FirstCalls | None) -> CaptureEstimate:
    """`best` with its peak counted in the caching allocator's blocks (`estimate_capture_plans`)."""
    chains = _chains(links)
    steps = [chain_requests([pairs[i] for i in chain], _chain_links(chain, links), block) for chain in chains]
    start = reserved = None
    if between is not None:
        first = None
        if facts is not None:  # (the workspaces are made once: by the first chain)
            later = dataclasses.replace(facts, workspace_bytes=0, lt_workspace_bytes=0)
            first = [chain_requests([pairs[i] for i in chain], _chain_links(chain, links), block,
                                    facts if k == 0 else later, chain)
                     for k, chain in enumerate(chains)]
        steady = steady_peak(allocator, steps, between, first, keep=frozenset(WORKSPACE_KEYS))
        peak, start, reserved = steady.peak, steady.start, steady.reserved
    else:
        peak = max(block_peak(allocator, requests) for requests in steps)
    at_peak = dict(best.at_peak)
    if peak > best.peak:
        at_peak["unsplit blocks"] = peak - best.peak
    return dataclasses.replace(best, peak=peak, at_peak=at_peak, blocks=True, steady_start=start,
                               steady_reserved=reserved,
                               workspaces_in_blocks=between is not None and bool(facts and facts.workspace_bytes))


# allocator keys of pair i start at (i + 1) times this (`estimate_step`'s key_base): above any device
# address, which a replayed capture's resident blocks are keyed by
_KEYS_PER_PAIR = 10 ** 15


def _chains(links: Sequence[Mapping[str, int]]) -> list[list[int]]:
    """The pairs that run as one step, each chain in compile order: a pair joins the chain of every
    earlier pair it takes a value from."""
    chain_of = list(range(len(links)))

    def root(i: int) -> int:
        while chain_of[i] != i:
            i = chain_of[i]
        return i

    for j, linked in enumerate(links):
        for i in linked.values():
            chain_of[root(j)] = root(i)
    chains: dict[int, list[int]] = {}
    for i in range(len(links)):
        chains.setdefault(root(i), []).append(i)
    return list(chains.values())


def _chain_links(chain: Sequence[int], links: Sequence[Mapping[str, int]]) -> list[dict[str, int]]:
    """`links` of the chain's pairs, as positions in the chain."""
    where = {p: k for k, p in enumerate(chain)}
    return [{n: where[i] for n, i in links[p].items() if i in where} for p in chain]


def peak_breakdown(plan: Plan, walk: GraphWalk, role: str, origins: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """What is live at a walk's peak (`walk_wrapper(..., explain=True)`), by memprof.analysis.attribution's
    categories, the step's own allocations only: the forward's saved activations and dropout masks
    held into the backward, recomputed values (a backward buffer whose primary FX origin is a
    recomputed forward node), the gradients the backward returns, fallback kernels' scratch
    (workspace), tangents (input) and temporaries. `origins`: the compiled graph's buffer -> FX
    nodes map."""
    recomputed, saved, masks = set(plan.recomputed), set(plan.saved), set(plan.masks)
    out: dict[str, int] = {}
    for name, nbytes in walk.peak_makers:
        if name.startswith("scratch "):
            cat = "workspace"
        elif name.startswith("input "):
            node = name.removeprefix("input ")
            cat = ("rng_mask" if node in masks else "saved_activation") if node in saved else "input"
        elif name in walk.returned:
            cat = "gradient" if role == "backward" else "saved_activation"
        else:
            nodes = origins.get(name) or ()
            primary = nodes[-1] if nodes else ""
            if role == "backward" and primary in recomputed:
                cat = "rng_mask" if primary in masks else "recomputed"
            else:
                cat = "temporary"
        out[cat] = out.get(cat, 0) + nbytes
    return out


def kept_tangents(plan: Plan, torch_version: str, observed: Sequence[str] | None = None) -> frozenset[str]:
    """The backward's tangents that stay live until it returns: those a capture saw outlive the
    compiled call (`observed`, `memprof.torch_hooks.runtime.TangentWatch`), else what the torch
    version does with the engine's gradients (2.11 holds them; 2.13 frees each at the `del`), which
    cannot see the loss: `.sum()`'s expanded ones, copied contiguous by AOTAutograd, are freed at the
    `del` on 2.11 too, and a gradient the script keeps (`out.backward(grad)`) is held on 2.13 too."""
    if observed is not None:
        return frozenset(observed) & _tangents(plan)
    return _tangents(plan) if tangents_held(torch_version) else frozenset()


def tangents_held(torch_version: str) -> bool:
    """Whether a torch version holds every tangent to the backward's end (`kept_tangents`)."""
    parts = torch_version.split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return False
    return (major, minor) < (2, 12)


def _tangents(plan: Plan) -> frozenset[str]:
    return frozenset(n.name for n in plan.backward.nodes if n.op == "placeholder" and n.name.startswith("tangents"))
