"""Distributed categories (pure): what FSDP2 and DDP allocate, told apart from the rest.

FSDP2 (`fully_shard`) opens a `record_function` scope around each of its steps, and memprof
records those scopes: what is allocated inside `FSDP::all_gather_copy_out` is an unsharded
parameter (it lives until the reshard frees it), inside `FSDP::all_gather` an all-gather buffer,
inside `FSDP::post_backward_reduce` a reduce-scatter buffer (the new sharded gradient made there is
a known tensor, and stays a gradient); a backward allocation outside FSDP's scopes that dies inside
`FSDP::post_backward_*` is the gradient of an unsharded parameter (an eager one, or a compiled
backward's gradient output). DDP opens no scope where its
reducer allocates its gradient buckets, so memprof marks those calls itself
(`torch_hooks.runtime.on_ddp_buckets`): what they allocate and outlives them is a bucket.

Otherwise only allocations outside compiled graphs are relabelled: FSDP2's and DDP's own code runs
eagerly.
"""

from __future__ import annotations

import numpy as np

from memprof._events import Kind
from memprof.analysis.labels import Category, LabelContext
from memprof.analysis.scopes import inside
from memprof.analysis.timeline import mark_windows

DDP_BUCKETS_BEGIN = "ddp: buckets begin"
DDP_BUCKETS_END = "ddp: buckets end"
COLLECTIVE_PREFIX = "c10d::"  # the dispatcher's name for every collective op (c10d::broadcast_, ...)
# scope-name prefixes, the more specific first (all_gather_copy_out also starts with all_gather)
FSDP_SCOPES = (("FSDP::all_gather_copy_out", Category.UNSHARDED_PARAMETER),
               ("FSDP::all_gather", Category.ALL_GATHER),
               ("FSDP::post_backward_reduce", Category.REDUCE_SCATTER))
FSDP_POST_BACKWARD = "FSDP::post_backward"
DISTRIBUTED = frozenset({Category.UNSHARDED_PARAMETER, Category.UNSHARDED_GRADIENT, Category.ALL_GATHER,
                         Category.REDUCE_SCATTER, Category.DDP_BUCKET})


def _scopes(ctx: LabelContext, prefix: str, exclude: str = "") -> list[tuple[int, int, int, int]]:
    ids = [i for s, i in ctx.scope_id.items() if s.startswith(prefix) and not (exclude and s.startswith(exclude))]
    return ctx.scopes.outermost(ids)


def label_distributed(ctx: LabelContext, eager: np.ndarray, joined: np.ndarray, in_backward: np.ndarray) -> None:
    """Relabel the allocations (timeline positions; `eager` outside compiled graphs, `joined` inside
    them) that FSDP2 or DDP made."""
    _unsharded_gradients(ctx, np.concatenate([eager, joined[ctx.category[joined] == Category.GRADIENT]]),
                         in_backward)
    if not len(eager):
        return
    rows, threads = ctx.tl.rows[eager], ctx.thread[eager]
    done = np.zeros(len(eager), dtype=bool)
    exclude = ""
    for prefix, category in FSDP_SCOPES:
        intervals = _scopes(ctx, prefix, exclude)
        exclude = exclude or prefix  # FSDP::all_gather does not take what copy_out took
        where = inside(rows, threads, intervals)
        hit = (where >= 0) & ~done
        for i in np.flatnonzero(hit).tolist():
            scope = ctx.strings[intervals[int(where[i])][3]]
            ctx.category[eager[i]], ctx.node[eager[i]] = category, ctx.names(f"fsdp:{scope}")
        done |= hit
    windows = mark_windows(ctx.raw, ctx.strings, DDP_BUCKETS_BEGIN, DDP_BUCKETS_END)
    if windows:
        where = inside(rows, threads, windows)
        ends = np.asarray([w[2] for w in windows], dtype=np.int64)
        buckets = (where >= 0) & ~done
        buckets &= ctx.free_row[eager] > ends[np.maximum(where, 0)]  # outlives the call that made it
        # and is made after the call's last collective: the rebuild first broadcasts the new bucket
        # layout (`sync_bucket_indices`: a few int32 bytes a gloo thread lets go of, at times well
        # after the call), then makes the buckets
        buckets &= rows > _last_collective(ctx, windows)[np.maximum(where, 0)]
        ctx.category[eager[buckets]] = Category.DDP_BUCKET
        ctx.node[eager[buckets]] = ctx.names("ddp:buckets")


def _last_collective(ctx: LabelContext, windows: list[tuple[int, int, int, int]]) -> np.ndarray:
    """Per window, the row of the last collective (a `c10d::` scope) its thread began in it, or its start."""
    ids = np.asarray([i for s, i in ctx.scope_id.items() if s.startswith(COLLECTIVE_PREFIX)], dtype=np.int64)
    begins = np.flatnonzero((ctx.raw["kind"] == Kind.SCOPE_BEGIN) & np.isin(ctx.raw["scope"], ids))
    where = inside(begins, ctx.raw["thread"][begins].astype(np.int64), windows)
    last = np.asarray([w[1] for w in windows], dtype=np.int64)
    np.maximum.at(last, where[where >= 0], begins[where >= 0])
    return last

def _unsharded_gradients(ctx: LabelContext, pos: np.ndarray, in_backward: np.ndarray) -> None:
    """Backward allocations outside FSDP's scopes that die inside `FSDP::post_backward_*`."""
    post = _scopes(ctx, FSDP_POST_BACKWARD)
    if not post or not len(pos):
        return
    free_row = ctx.free_row[pos]
    freed = free_row < len(ctx.raw)
    free_thread = np.where(freed, ctx.raw["thread"][np.minimum(free_row, len(ctx.raw) - 1)].astype(np.int64), -1)
    in_fsdp = inside(ctx.tl.rows[pos], ctx.thread[pos], _scopes(ctx, "FSDP::")) >= 0
    grads = freed & (inside(free_row, free_thread, post) >= 0) & in_backward[pos] & ~in_fsdp
    ctx.category[pos[grads]] = Category.UNSHARDED_GRADIENT
