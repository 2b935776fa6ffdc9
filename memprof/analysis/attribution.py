"""Attribution: what every captured allocation is, which FX node and layer made it, and why it is live.

Pure analysis over the event array, a device timeline and the compile plans (no torch, no I/O).

Allocations inside compiled-graph calls are joined to the graph's wrapper code (`join`). Buffers
lead to FX nodes (Inductor's own origins) and to the plan: forward outputs after
`num_fwd_outputs` are saved activations, backward buffers computed by nodes that also exist in
the forward are recomputed, boolean values drawn from random ops are RNG masks. Allocations
outside compiled graphs are classified from their eager scope and lifetime; known parameters,
gradients and optimizer state (recorded by ptr) take precedence.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memprof._events import FLAG_OTHER_THREAD, CarriedBlock, Events, Kind, ids_for, index_dtype
from memprof.analysis.carried import label_carried
from memprof.analysis.distributed import label_distributed
from memprof.analysis.garbage import gc_freed_positions
from memprof.analysis.join import join_call
from memprof.analysis.labels import (
    BEFORE_CAPTURE,
    CATEGORIES,
    CATEGORY_OF_KNOWN,
    CallJoin,
    Category,
    LabelContext,
    Labels,
    known_layer,
    small_unique,
)
from memprof.analysis.scopes import ScopeIndex, inside
from memprof.analysis.timeline import Timeline
from memprof.analysis.zero_grads import label_zero_grads
from memprof.plans import CompiledGraph, KnownTensor, Plan

__all__ = ["BEFORE_CAPTURE", "BY", "CATEGORIES", "AttributionRow", "CallJoin", "Category", "Labels",
           "category_series", "category_start", "label_timeline", "point_of", "rows_at"]

BY = ("category", "node", "layer", "kernel")
_GRAPH_CALL = "## Call CompiledFxGraph "
BACKWARD_SCOPES = (  # scope names that open a backward pass
    "autograd::engine::evaluate_function", "CompiledFunctionBackward")
OPTIMIZER_SCOPES = ("Optimizer.step#", "Optimizer.zero_grad#")


@dataclass(frozen=True)
class AttributionRow:
    key: str
    bytes: int
    count: int
    share: float  # of the live bytes at that point
    category: str  # the category (for by=category: the key itself; else the largest one in the row)


def _in_backward(ctx: LabelContext, backward_calls: list[tuple[int, int, int, int]]) -> np.ndarray:
    """Per timeline position: on an autograd worker thread, or inside a backward scope. CPU events of
    other threads (intra-op workers, Python threads: FLAG_OTHER_THREAD) are not autograd's."""
    tl = ctx.tl
    in_scope = inside(tl.rows, ctx.thread, backward_calls) >= 0
    if ctx.main_thread is None:
        return in_scope
    autograd_thread = (ctx.raw["flags"][tl.rows] & FLAG_OTHER_THREAD) == 0
    return np.asarray(in_scope | ((ctx.thread != ctx.main_thread) & autograd_thread))


def _join_calls(ctx: LabelContext, calls: list[tuple[int, int, int, int]], alloc_pos: np.ndarray,
                call_of: np.ndarray, freed_in_bw: np.ndarray) -> list[CallJoin]:
    order = np.argsort(call_of, kind="stable")
    sorted_calls = call_of[order]
    starts = np.searchsorted(sorted_calls, np.arange(len(calls)), side="left")
    ends = np.searchsorted(sorted_calls, np.arange(len(calls)), side="right")
    joins: list[CallJoin] = []
    for ci, (thread, b, e, scope) in enumerate(calls):
        key = ctx.strings[scope][len(_GRAPH_CALL):].removesuffix(" ##")
        joins.append(join_call(ctx, thread, b, e, key, alloc_pos[order[starts[ci]:ends[ci]]], freed_in_bw))
    return joins


def eager_categories(in_optimizer: np.ndarray, outlives_optimizer: np.ndarray, is_grad: np.ndarray,
                     in_backward: np.ndarray, freed_in_bw: np.ndarray, is_input: np.ndarray) -> np.ndarray:
    """The category of each allocation outside compiled graphs, from its eager scope and lifetime: made
    in an optimizer step, optimizer state if it outlives the step (else a temporary); else a gradient
    (AccumulateGrad); else a temporary of the backward; else a saved activation if a backward frees it;
    else an input if it was made before the first compiled call or backward or spans a step; else a
    temporary. (Arrays: a capture can hold millions.)"""
    cat = np.where(is_input, np.int8(Category.INPUT), np.int8(Category.TEMPORARY))  # each rule over the last
    cat[freed_in_bw] = Category.SAVED_ACTIVATION
    cat[in_backward] = Category.TEMPORARY
    cat[is_grad] = Category.GRADIENT
    cat[in_optimizer] = np.where(outlives_optimizer[in_optimizer], np.int8(Category.OPTIMIZER_STATE),
                                 np.int8(Category.TEMPORARY))
    return cat


def _grad_scopes(ctx: LabelContext) -> np.ndarray:
    return np.asarray(sorted(i for s, i in ctx.scope_id.items() if "AccumulateGrad" in s), dtype=np.uint32)


def _label_eager(ctx: LabelContext, eager: np.ndarray, opts: list[tuple[int, int, int, int]], first_activity: int,
                 in_backward: np.ndarray, freed_in_bw: np.ndarray) -> None:
    """Allocations outside compiled graphs, from their eager scope and lifetime (`eager_category`,
    by arrays: a capture can hold millions; each array of theirs let go once used, since at ten
    million events they are what a report's peak memory is made of)."""
    escope = ctx.raw["scope"][ctx.tl.rows[eager]]
    ctx.category[eager] = _eager_categories(ctx, eager, escope, opts, first_activity, in_backward, freed_in_bw)
    ids, inverse = small_unique(escope)
    del escope
    kerns = [ctx.strings[int(i)] or "(no scope)" for i in ids.tolist()]
    node_ids = np.asarray([ctx.names(f"eager:{k}") for k in kerns], dtype=np.int32)
    kern_ids = np.asarray([ctx.names(k) for k in kerns], dtype=np.int32)
    ctx.node[eager] = node_ids[inverse] if len(ids) else 0
    ctx.layer[eager] = 0
    ctx.kernel[eager] = kern_ids[inverse] if len(ids) else 0


def _eager_categories(ctx: LabelContext, eager: np.ndarray, escope: np.ndarray, opts: list[tuple[int, int, int, int]],
                      first_activity: int, in_backward: np.ndarray, freed_in_bw: np.ndarray) -> np.ndarray:
    """`eager_categories` of the eager allocations at positions `eager` (`escope`: their scopes)."""
    raw, tl = ctx.raw, ctx.tl
    erows = tl.rows[eager]
    in_opt = inside(erows, ctx.thread[eager], opts)
    opt_end = np.asarray([o[2] for o in opts] + [0], dtype=index_dtype(len(raw)))
    steps = np.flatnonzero(raw["kind"] == Kind.STEP)
    free_row = ctx.free_row[eager]
    spans_step = (np.searchsorted(steps, free_row) > np.searchsorted(steps, erows)) if len(steps) else \
        np.zeros(len(eager), bool)
    spans_step |= erows < first_activity
    del erows
    after_opt = free_row > opt_end[in_opt]
    del free_row
    is_grad = np.isin(escope, ids_for(escope, _grad_scopes(ctx).tolist()))
    return eager_categories(in_opt >= 0, after_opt, is_grad, in_backward[eager], freed_in_bw[eager], spans_step)


def _label_carried(ctx: LabelContext, carried: Sequence[CarriedBlock], in_backward: np.ndarray,
                   freed_in_bw: np.ndarray) -> None:
    """The blocks carried into a step window or a ring (`label_carried`), eager ones as `eager_categories`."""
    grads = _grad_scopes(ctx)

    def carried_eager(pos: int, in_optimizer: bool, in_bw: bool) -> Category:
        # a carried block is live where the stored steps begin: it outlived the optimizer step that
        # made it, and spans a step
        is_grad = np.isin(ctx.raw["scope"][ctx.tl.rows[pos : pos + 1]], grads)
        yes = np.ones(1, dtype=bool)
        return Category(int(eager_categories(yes & in_optimizer, yes, is_grad, yes & in_bw,
                                             freed_in_bw[pos : pos + 1], yes)[0]))

    label_carried(ctx, carried, in_backward, freed_in_bw, carried_eager, OPTIMIZER_SCOPES, BACKWARD_SCOPES)


def label_timeline(
    raw: Events,
    strings: Sequence[str],
    tl: Timeline,
    plans: Sequence[Plan] = (),
    graphs: Sequence[CompiledGraph] = (),
    tensors: Sequence[KnownTensor] = (),
    main_thread: int | None = None,
    preexisting: Sequence[tuple[int, int]] = (),
    scopes: ScopeIndex | None = None,
    known_until: int | None = None,
    carried: Sequence[CarriedBlock] = (),
    tail_from: int | None = None,
    gc_freed: np.ndarray | None = None,
) -> Labels:
    """Category, FX node, layer and kernel of every allocation on one device's timeline.

    `preexisting` are (ptr, bytes) of the blocks live when the capture started (CUDA); `scopes`
    the capture's scope index (built here when not given); `known_until` the time after which known
    tensors are not used (a step window's end); `carried` where the blocks carried into a step
    window or a ring were allocated (`memprof.analysis.carried`); `tail_from` the row after which a
    closed window's tail begins (the frees of its blocks and the next step's scopes: no call there
    allocates, so none is joined); `gc_freed` the positions of the frees Python's cyclic collector
    made (`garbage.gc_freed_positions`, found here when not given).
    """
    ctx = LabelContext(raw, strings, tl, plans, graphs, main_thread, scopes or ScopeIndex(raw))
    alloc_pos = np.flatnonzero(tl.is_alloc).astype(index_dtype(ctx.n), copy=False)
    sid = ctx.scope_id
    calls = ctx.scopes.outermost([i for s, i in sid.items() if s.startswith(_GRAPH_CALL)])
    if tail_from is not None:
        calls = [c for c in calls if c[1] < tail_from]
    bws = ctx.scopes.outermost([i for s, i in sid.items() if s.startswith(BACKWARD_SCOPES)])
    opts = ctx.scopes.outermost([i for s, i in sid.items() if s.startswith(OPTIMIZER_SCOPES)])
    in_backward = _in_backward(ctx, bws)
    # frees: where did the allocation die? (a free Python's cyclic collector made is not the backward's
    # own, even when a collection runs inside it: a tensor held in a reference cycle, freed late)
    free_pos = tl.free_of
    freed_in_bw = np.zeros(ctx.n, dtype=bool)
    has_free = free_pos >= 0
    freed_by_bw = in_backward.copy()
    freed_by_bw[gc_freed_positions(raw, tl, strings) if gc_freed is None else gc_freed] = False
    freed_in_bw[has_free] = freed_by_bw[free_pos[has_free]]
    call_of = inside(tl.rows[alloc_pos], ctx.thread[alloc_pos], calls)
    joins = _join_calls(ctx, calls, alloc_pos, call_of, freed_in_bw) if calls else []
    eager = alloc_pos[call_of < 0]
    if len(eager):
        first_activity = min([c[1] for c in calls] + [b[1] for b in bws] + [len(raw)])
        _label_eager(ctx, eager, opts, first_activity, in_backward, freed_in_bw)
        label_zero_grads(ctx, eager)
    if carried:
        _label_carried(ctx, carried, in_backward, freed_in_bw)
    label_distributed(ctx, eager, alloc_pos[call_of >= 0], in_backward)
    # known tensors (parameters, gradients, optimizer state) override by pointer and time; those recorded
    # after a step window closed may name a block at a reused address whose free was not stored
    if known_until is not None:
        tensors = [t for t in tensors if t[0] <= known_until]
    if tensors:
        _apply_known(ctx, tensors, alloc_pos)
    # frees carry their allocation's labels (free_of maps alloc -> free); the passes' arrays go first
    del in_backward, freed_by_bw, freed_in_bw, call_of, eager, alloc_pos
    f = np.flatnonzero(has_free).astype(index_dtype(ctx.n), copy=False)
    del has_free
    dst = free_pos[f]
    for arr in (ctx.category, ctx.node, ctx.layer, ctx.kernel):
        arr[dst] = arr[f]
    del f, dst
    pre = _label_preexisting(ctx, preexisting, tensors)
    # (ids in int16 where the names allow: a capture of millions of allocations holds three such
    # arrays; each int32 one is let go as its copy is made)
    ids_t = np.int16 if len(ctx.names.names) < 2**15 else np.int32
    spent = np.zeros(0, np.int32)
    node, ctx.node = ctx.node.astype(ids_t), spent
    layer, ctx.layer = ctx.layer.astype(ids_t), spent
    kernel, ctx.kernel = ctx.kernel.astype(ids_t), spent
    return Labels(ctx.category, node, layer, kernel, ctx.names.names, joins, *pre)


def _label_preexisting(ctx: LabelContext, blocks: Sequence[tuple[int, int]],
                       tensors: Sequence[KnownTensor]) -> tuple[np.ndarray, ...]:
    """Labels of the blocks live at the capture start; their frees (unpaired) get the same labels."""
    tl = ctx.tl
    n = len(blocks)
    size = np.asarray([b[1] for b in blocks], dtype=np.int64)
    free = np.full(n, ctx.n, dtype=np.int64)
    cat = np.full(n, Category.UNATTRIBUTED, dtype=np.int8)
    node = np.full(n, ctx.names(BEFORE_CAPTURE), dtype=np.int32)
    layer = np.zeros(n, dtype=np.int32)
    kernel = np.full(n, ctx.names(BEFORE_CAPTURE), dtype=np.int32)
    if not n or int(size.sum()) > tl.baseline:  # no snapshot, or one that disagrees with the baseline
        return tuple(a[:0] for a in (size, free, cat, node, layer, kernel))
    unpaired = np.flatnonzero(~tl.is_alloc & (tl.alloc_of < 0))
    frees: dict[int, list[int]] = defaultdict(list)
    for p, ptr in zip(unpaired.tolist(), ctx.raw["ptr"][tl.rows[unpaired]].tolist(), strict=True):
        frees[int(ptr)].append(p)
    known: dict[int, list[tuple[int, str, str]]] = defaultdict(list)
    for t_ns, device, ptr, _nbytes, category, name in tensors:
        if device == tl.device:
            known[ptr].append((t_ns, category, name))
    for i, (ptr, _) in enumerate(blocks):
        if frees.get(ptr):
            free[i] = frees[ptr].pop(0)
        t_free = int(tl.t_at(free[i])) if free[i] < ctx.n else np.iinfo(np.int64).max
        for t_ns, category, name in known.get(ptr, []):
            c = CATEGORY_OF_KNOWN.get(category)
            if c is not None and t_ns < t_free:
                cat[i], node[i], layer[i] = c, ctx.names(f"{category}:{name}"), ctx.names(known_layer(name))
                break
        if free[i] < ctx.n:
            ctx.category[free[i]], ctx.node[free[i]] = cat[i], node[i]
            ctx.layer[free[i]], ctx.kernel[free[i]] = layer[i], kernel[i]
    return size, free, cat, node, layer, kernel


def _apply_known(ctx: LabelContext, tensors: Sequence[KnownTensor], alloc_pos: np.ndarray) -> None:
    """Name the allocations the known tensors (parameters, gradients, optimizer state) live in: each
    known tensor is the latest allocation at its address made by its time and not yet freed then;
    a later record of the same allocation wins."""
    tl = ctx.tl
    mine = [t for t in tensors if t[1] == tl.device]
    if not mine or not len(alloc_pos):
        return
    ptrs = ctx.raw["ptr"][tl.rows[alloc_pos]].astype(np.uint64)
    t_alloc = tl.t_at(alloc_pos)
    t_free = np.where(tl.free_of[alloc_pos] >= 0, tl.t_at(np.maximum(tl.free_of[alloc_pos], 0)), np.iinfo(np.int64).max)
    k_ptr = np.asarray([t[2] for t in mine], np.uint64)
    k_t = np.asarray([t[0] for t in mine], np.int64)
    # allocations and known tensors in one order (address, time; an allocation before a record at its
    # time): each record's allocation is the last allocation before it at its address
    n = len(alloc_pos)
    ptr_all, t_all = np.concatenate([ptrs, k_ptr]), np.concatenate([t_alloc, k_t])
    is_alloc = np.concatenate([np.ones(n, bool), np.zeros(len(mine), bool)])
    order = np.lexsort((~is_alloc, t_all, ptr_all))
    last = np.maximum.accumulate(np.where(is_alloc[order], np.arange(len(order)), -1))
    at = np.empty(len(order), np.int64)
    at[order] = np.arange(len(order))
    j = last[at[n:]]  # per record: the merged index of its allocation candidate (-1: none)
    a = np.where(j >= 0, order[np.maximum(j, 0)], 0)
    ks = np.flatnonzero((j >= 0) & (ptrs[a] == k_ptr) & (t_free[a] > k_t))
    pos = alloc_pos[a[ks]]
    cat = np.asarray([CATEGORY_OF_KNOWN.get(mine[k][4], -1) for k in ks.tolist()], dtype=np.int8)
    # (gradients as views into DDP's bucket, gradient_as_bucket_view: the block stays the bucket)
    keep = (cat >= 0) & ~((cat == Category.GRADIENT) & (ctx.category[pos] == Category.DDP_BUCKET))
    ks, pos, cat = ks[keep], pos[keep], cat[keep]
    # a record's labels once per (category, name): a capture records each tensor at every step
    ids: dict[tuple[str, str], tuple[int, int]] = {}
    node, layer = np.empty(len(ks), np.int32), np.empty(len(ks), np.int32)
    for i, k in enumerate(ks.tolist()):
        key = (mine[k][4], mine[k][5])
        got = ids.get(key)
        if got is None:
            got = ids[key] = (ctx.names(f"{key[0]}:{key[1]}"), ctx.names(known_layer(key[1])))
        node[i], layer[i] = got
    last = len(pos) - 1 - np.unique(pos[::-1], return_index=True)[1]  # the later record of an allocation wins
    ctx.category[pos[last]], ctx.node[pos[last]], ctx.layer[pos[last]] = cat[last], node[last], layer[last]


def point_of(tl: Timeline, at: str, steps: Sequence[tuple[int, int]]) -> int:
    """Timeline position for `at`: "peak" or "step:N" (the peak within step N); -1 = baseline.

    `steps` are (step number, timeline position of its peak) as `timeline.step_stats` finds them.
    """
    if at == "peak":
        return tl.peak_pos
    if at.startswith("step:"):
        try:
            number = int(at[5:])
        except ValueError:
            raise ValueError(f"bad point {at!r}: expected 'peak' or 'step:N'") from None
        for s, peak_pos in steps:
            if s == number:
                return peak_pos
        raise ValueError(f"no step {number} in this capture (steps: {[s for s, _ in steps]})")
    raise ValueError(f"bad point {at!r}: expected 'peak' or 'step:N'")


def rows_at(tl: Timeline, labels: Labels, pos: int, by: str) -> list[AttributionRow]:
    """Live bytes at timeline position `pos`, grouped; rows sum exactly to the live bytes there."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}, got {by!r}")
    total = tl.allocated_at_pos(pos)
    live = tl.live_positions(pos) if pos >= 0 else np.zeros(0, np.int64)
    sizes = tl.delta_at(live)
    cats = labels.category[live].astype(np.int64)
    keys = cats if by == "category" else labels.label(by)[live].astype(np.int64)
    names = list(CATEGORIES) if by == "category" else labels.names
    pre = np.flatnonzero(labels.pre_free > pos)
    before = total - int(sizes.sum())
    if len(pre) and int(labels.pre_size[pre].sum()) <= before:  # blocks from the start snapshot
        sizes = np.concatenate([sizes, labels.pre_size[pre]])
        pre_cats = labels.pre_category[pre].astype(np.int64)
        cats = np.concatenate([cats, pre_cats])
        keys = np.concatenate([keys, pre_cats if by == "category" else labels.pre_label(by)[pre].astype(np.int64)])
        live = np.concatenate([live, -1 - pre])
        before = total - int(sizes.sum())
    out: dict[str, list[int]] = {}
    cat_bytes: dict[str, np.ndarray] = {}
    if len(live):
        uniq, inv = np.unique(keys, return_inverse=True)
        b = np.bincount(inv, weights=sizes, minlength=len(uniq)).astype(np.int64)
        c = np.bincount(inv, minlength=len(uniq))
        per_cat = np.zeros((len(uniq), len(CATEGORIES)), dtype=np.int64)
        np.add.at(per_cat, (inv, cats), sizes)
        for u, bb, cc, pc in zip(uniq.tolist(), b.tolist(), c.tolist(), per_cat, strict=True):
            name = names[u] or "(unknown)"
            out[name] = [bb, cc]
            cat_bytes[name] = pc
    if before:
        key = "unattributed" if by == "category" else BEFORE_CAPTURE
        prev = out.get(key, [0, 0])
        out[key] = [prev[0] + before, prev[1]]
        pc = cat_bytes.get(key, np.zeros(len(CATEGORIES), np.int64)).copy()
        pc[Category.UNATTRIBUTED] += before
        cat_bytes[key] = pc
    rows = [
        AttributionRow(key=k, bytes=v[0], count=v[1], share=(v[0] / total) if total else 0.0,
                       category=k if by == "category" else CATEGORIES[int(np.argmax(cat_bytes[k]))])
        for k, v in out.items()
    ]
    rows.sort(key=lambda r: (-r.bytes, r.key))
    return rows


def category_series(tl: Timeline, labels: Labels, keep: np.ndarray | None = None) -> np.ndarray:
    """Live bytes per category after timeline events `keep` (default: all): shape (len(keep), categories)."""
    idx = np.arange(len(tl.rows)) if keep is None else np.asarray(keep, dtype=np.int64)
    out = np.zeros((len(idx), len(CATEGORIES)), dtype=np.int64)
    cats, delta = labels.category.astype(np.int64), tl.delta
    for c in range(len(CATEGORIES)):
        sel = cats == c
        if sel.any():
            out[:, c] = np.cumsum(np.where(sel, delta, 0))[idx]
    return np.asarray(out + category_start(tl, labels))


def category_start(tl: Timeline, labels: Labels) -> np.ndarray:
    """Live bytes per category before the timeline's first event: the baseline, unattributed but for
    the blocks live at the start that the capture's snapshot labelled."""
    start = np.zeros(len(CATEGORIES), dtype=np.int64)
    start[Category.UNATTRIBUTED] = tl.baseline
    if len(labels.pre_size) and int(labels.pre_size.sum()) <= tl.baseline:
        np.add.at(start, labels.pre_category.astype(np.int64), labels.pre_size)
        start[Category.UNATTRIBUTED] -= int(labels.pre_size.sum())
    return start
