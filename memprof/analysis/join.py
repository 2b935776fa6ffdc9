"""The join of one compiled-graph call's runtime allocations to its wrapper code.

Inside a `## Call CompiledFxGraph <key> ##` scope, the allocations the wrapper makes itself open
no nested scope: they are its `empty_strided_*` buffers, in order. An allocation inside a
nested scope belongs to that extern call or kernel launch, matched by name and occurrence. The
join is verified on every call (count and size of each direct allocation, symbolic sizes
solved); a call that does not verify is attributed at kernel level, from lifetimes only, and
says why.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from memprof.analysis.labels import CallJoin, Category, LabelContext, node_layer
from memprof.analysis.units import block_fits
from memprof.analysis.wrapper_code import WrapperCode, check_symbolic_sizes
from memprof.plans import CompiledGraph, Plan

_ROLE_TAGS = {"forward": "fw", "backward": "bw", "inference": "inf"}


@dataclass(frozen=True)
class CallNesting:
    """Where each allocation of one call happened, relative to the call's top-level scopes."""

    rows: np.ndarray  # event row of each allocation
    is_direct: np.ndarray  # made by the wrapper itself (its innermost scope is the call's)
    child_of: np.ndarray  # index of the top-level scope holding it, -1 if none
    child_scope: np.ndarray  # scope id of each top-level scope
    survives_call: np.ndarray  # freed after the call ends (or never)
    freed_in_child: np.ndarray  # freed inside the top-level scope that made it

    @property
    def in_child(self) -> np.ndarray:
        return self.child_of >= 0


def nesting(ctx: LabelContext, thread: int, begin: int, end: int, graph: CompiledGraph | None,
            alloc_pos: np.ndarray) -> CallNesting:
    """The call's top-level scopes and which of them made each allocation. Only scopes named in the
    wrapper count: others (autotuning on a first call, for one) may begin without a matching end on
    this thread and would hide the nesting."""
    raw = ctx.raw
    rows = ctx.tl.rows[alloc_pos]
    is_direct = raw["scope"][rows] == int(raw["scope"][begin])
    named = None
    if graph is not None:
        names = {c.scope for c in graph.wrapper.calls if c.scope is not None}
        named = [ctx.scope_id[n] for n in names if n in ctx.scope_id]
    child_b, child_e, child_scope = ctx.scopes.children(thread, begin, end, named)
    k = np.searchsorted(child_b, rows, side="right") - 1
    child_end = child_e[np.maximum(k, 0)] if len(child_b) else np.full(len(rows), -1, dtype=np.int64)
    in_child = ~is_direct & (k >= 0) & (rows < child_end)
    free_row = ctx.free_row[alloc_pos]
    return CallNesting(rows, is_direct, np.where(in_child, k, -1), child_scope, free_row > end,
                       in_child & (free_row < child_end))


def verify(ctx: LabelContext, graph: CompiledGraph | None, n: CallNesting, alloc_pos: np.ndarray,
           interrupted: bool = False) -> str:
    """Why the buffer join cannot be used for this call ("" when it verifies). A call that did not
    end in the capture (`interrupted`: an OOM, an exception, a kill) verifies when what it
    allocated is a prefix of the wrapper's allocations."""
    if graph is None:
        return "no compile plan for this graph (compiled before the capture started?)"
    if graph.notes:
        return ", ".join(graph.notes)
    if graph.wrapper.unsupported:
        return ", ".join(graph.wrapper.unsupported)
    expected = graph.wrapper.expected_allocs
    direct = np.flatnonzero(n.is_direct)
    if len(direct) != len(expected) and not (interrupted and len(direct) < len(expected)):
        return f"{len(direct)} wrapper allocations at run time, {len(expected)} in the wrapper code"
    expected = expected[: len(direct)]
    cpu = ctx.tl.device == "cpu"
    sizes = ctx.tl.delta_at(alloc_pos[direct]).tolist()
    for alloc, size in zip(expected, sizes, strict=True):
        if not block_fits(alloc.nbytes, int(size), cpu):
            return f"{alloc.buf}: {size} bytes allocated, {alloc.nbytes} expected"
    # symbolic sizes (dynamic shapes): some values of the size symbols must explain them all
    return check_symbolic_sizes([(a, int(b)) for a, b in zip(expected, sizes, strict=True) if a.nbytes is None], cpu)


def _child_name(ctx: LabelContext, n: CallNesting, c: int) -> str:
    return ctx.strings[int(n.child_scope[c])] if c >= 0 else ""


def kernel_level_category(role: str, in_child: bool, freed_in_child: bool, survives_call: bool,
                          freed_in_bw: bool) -> Category:
    """The category of one allocation of a call attributed at kernel level: from its lifetime only."""
    if freed_in_child or (in_child and not survives_call and role != "backward"):
        return Category.WORKSPACE if freed_in_child else Category.TEMPORARY
    if not survives_call:
        return Category.TEMPORARY
    if role == "backward":
        return Category.GRADIENT
    return Category.SAVED_ACTIVATION if freed_in_bw else Category.TEMPORARY


def label_kernel_level(ctx: LabelContext, n: CallNesting, alloc_pos: np.ndarray, role: str, tag: str,
                       freed_in_bw: np.ndarray) -> None:
    """Categories from lifetimes only, labelled by the kernel that allocated."""
    for i in range(len(alloc_pos)):
        kern = _child_name(ctx, n, int(n.child_of[i])) or (
            ctx.strings[int(ctx.raw["scope"][n.rows[i]])] if not n.is_direct[i] else "(wrapper allocation)")
        cat = kernel_level_category(role, bool(n.in_child[i]), bool(n.freed_in_child[i]), bool(n.survives_call[i]),
                                    bool(freed_in_bw[alloc_pos[i]]))
        ctx.set(alloc_pos[i], cat, f"{tag}:{kern}", "", kern)


def _calls_of_children(ctx: LabelContext, n: CallNesting, wrapper: WrapperCode) -> list[int | None]:
    """The wrapper call behind each top-level scope: the k-th scope of a name is its k-th call."""
    seen: dict[str, int] = defaultdict(int)
    out: list[int | None] = []
    for child in range(len(n.child_scope)):
        name = _child_name(ctx, n, child)
        occ = seen[name]
        seen[name] += 1
        cands = wrapper.calls_by_scope.get(name, [])
        out.append(cands[occ] if occ < len(cands) else None)
    return out


class _BufferCategories:
    """The category of a buffer allocation from its graph's plan (saved, recomputed, masks)."""

    def __init__(self, plan: Plan | None, wrapper: WrapperCode, role: str, interrupted: bool = False) -> None:
        self.plan, self.role, self.interrupted = plan, role, interrupted
        self.nfo = plan.num_fwd_outputs if plan is not None else len(wrapper.outputs)
        self.out_positions: dict[str, list[int]] = defaultdict(list)
        for i, o in enumerate(wrapper.outputs):
            if o is not None:
                self.out_positions[o].append(i)
        # dropout randomness: boolean masks and the random values (or seeds) they are drawn from
        self.masks = set(plan.masks) | set(plan.random_ops) if plan is not None else set()
        self.recomputed = set(plan.recomputed) if plan is not None else set()

    def of(self, root: str, primary: str, survives_call: bool, freed_in_bw: bool) -> tuple[str, Category]:
        plan = self.plan
        saved = [plan.saved[p - self.nfo] for p in self.out_positions.get(root, [])
                 if plan is not None and self.nfo <= p < self.nfo + len(plan.saved)]
        if self.role == "forward" and saved:
            return saved[0], Category.RNG_MASK if any(s in self.masks for s in saved) else Category.SAVED_ACTIVATION
        if self.interrupted:  # a call cut short: what outlives it says nothing; what it returns would be
            if self.role == "backward" and root in self.out_positions:
                return primary, Category.GRADIENT
            survives_call = False
        if not survives_call:
            if self.role == "backward" and primary in self.recomputed:
                return primary, Category.RNG_MASK if primary in self.masks else Category.RECOMPUTED
            return primary, Category.TEMPORARY
        if self.role == "backward":
            return primary, Category.GRADIENT
        return primary, Category.SAVED_ACTIVATION if freed_in_bw else Category.TEMPORARY


@dataclass(frozen=True)
class CallLabeller:
    """Labels for the allocations of one call of a compiled graph (each call's own, or the blocks of
    one carried into a step window: `memprof.analysis.carried`)."""

    ctx: LabelContext
    graph: CompiledGraph
    plan: Plan | None
    categories: _BufferCategories
    tag: str

    @staticmethod
    def of(ctx: LabelContext, graph: CompiledGraph, plan: Plan | None, tag: str,
           interrupted: bool = False) -> CallLabeller:
        return CallLabeller(ctx, graph, plan, _BufferCategories(plan, graph.wrapper, graph.role, interrupted), tag)

    def unopened(self, pos: int, kern: str, survives_call: bool) -> None:
        """An allocation inside a scope the wrapper does not open (autotuning)."""
        self.ctx.set(pos, Category.WORKSPACE if not survives_call else Category.TEMPORARY, f"{self.tag}:{kern}", "",
                     kern)

    def direct(self, pos: int, root: str, survives_call: bool, freed_in_bw: bool) -> None:
        """The wrapper's own allocation of buffer `root`."""
        wrapper = self.graph.wrapper
        writer = wrapper.writer.get(root)
        writer_call = wrapper.calls[writer] if writer is not None else None
        kern = (writer_call.scope or writer_call.kernel) if writer_call is not None else "(no kernel)"
        self._buffer(pos, root, kern, survives_call, freed_in_bw)

    def in_child(self, pos: int, kern: str, call: int | None, freed_in_child: bool, survives_call: bool,
                 freed_in_bw: bool) -> None:
        """An allocation inside the top-level scope `kern` of the wrapper's call number `call`."""
        graph, wrapper = self.graph, self.graph.wrapper
        site = wrapper.calls[call] if call is not None else None
        if site is None or site.out is None or freed_in_child:  # a kernel's own scratch
            nodes = graph.origins.get(site.out or "", []) if site is not None else []
            if not nodes and site is not None:
                nodes = [x for a in site.args for x in graph.origins.get(wrapper.root(a), [])[-1:]]
            node = nodes[-1] if nodes else kern
            self.ctx.set(pos, Category.WORKSPACE, f"{self.tag}:{node}", node_layer(self.plan, graph.role, *nodes[::-1]),
                         kern)
            return
        self._buffer(pos, site.out, kern, survives_call, freed_in_bw)

    def _buffer(self, pos: int, root: str, kern: str, survives_call: bool, freed_in_bw: bool) -> None:
        origins = self.graph.origins.get(root, [])
        node, cat = self.categories.of(root, origins[-1] if origins else root, survives_call, freed_in_bw)
        self.ctx.set(pos, cat, f"{self.tag}:{node}", node_layer(self.plan, self.graph.role, node, *origins[::-1]), kern)


def call_tag(graph: CompiledGraph | None, plan: Plan | None) -> str:
    """A call's prefix in FX node labels: fw0, bw0, inf1, ... (graph: a graph without a plan)."""
    tag = _ROLE_TAGS.get(graph.role, "graph") if graph is not None else "graph"
    return f"{tag}{plan.index}" if plan is not None else tag


def label_buffers(ctx: LabelContext, n: CallNesting, alloc_pos: np.ndarray, graph: CompiledGraph,
                  plan: Plan | None, tag: str, freed_in_bw: np.ndarray, interrupted: bool = False) -> None:
    """Labels of a verified call: each allocation's buffer, FX node and category."""
    call_of_child = _calls_of_children(ctx, n, graph.wrapper)
    labeller = CallLabeller.of(ctx, graph, plan, tag, interrupted)
    expected = graph.wrapper.expected_allocs
    d = 0
    for i in range(len(alloc_pos)):
        pos, survives, in_bw = int(alloc_pos[i]), bool(n.survives_call[i]), bool(freed_in_bw[alloc_pos[i]])
        if n.is_direct[i]:
            labeller.direct(pos, expected[d].buf, survives, in_bw)
            d += 1
        elif n.in_child[i]:
            c = int(n.child_of[i])
            labeller.in_child(pos, _child_name(ctx, n, c), call_of_child[c], bool(n.freed_in_child[i]), survives, in_bw)
        else:
            labeller.unopened(pos, ctx.strings[int(ctx.raw["scope"][n.rows[i]])], survives)


def _call_shape(ctx: LabelContext, n: CallNesting, alloc_pos: np.ndarray, freed_in_bw: np.ndarray, key: str,
                interrupted: bool) -> tuple[str, bool, int, bytes]:
    """Everything `label_buffers` reads of one call, as a key: its graph, whether it was cut short,
    and per allocation whether the wrapper made it, in which top-level scope (and their names), the
    scope open when it was made, and whether it outlived the call, its scope, and the backward."""
    cols = [n.is_direct, n.child_of, n.survives_call, n.freed_in_child, freed_in_bw[alloc_pos],
            ctx.raw["scope"][n.rows], n.child_scope]
    return key, interrupted, len(alloc_pos), np.concatenate([np.asarray(c, np.int64) for c in cols]).tobytes()


def join_call(ctx: LabelContext, thread: int, begin: int, end: int, key: str, alloc_pos: np.ndarray,
              freed_in_bw: np.ndarray) -> CallJoin:
    """Label the allocations `alloc_pos` of one call (rows begin..end on `thread`) of graph `key`."""
    graph = ctx.graphs.get(key)
    role = graph.role if graph is not None else "unknown"
    plan = ctx.plans.get(graph.plan) if graph is not None and graph.plan is not None else None
    tag = call_tag(graph, plan)
    n = nesting(ctx, thread, begin, end, graph, alloc_pos)
    # the call was still running when the capture ended, or an OOM ended it (its scope closes as the
    # exception unwinds)
    oom = ctx.oom_rows
    interrupted = end >= len(ctx.raw) or bool(((oom > begin) & (oom < end)).any())
    reason = verify(ctx, graph, n, alloc_pos, interrupted)
    if reason:
        label_kernel_level(ctx, n, alloc_pos, role, tag, freed_in_bw)
        unseen = 0
        if graph is not None and not graph.notes and not graph.wrapper.unsupported:
            unseen = max(int(n.is_direct.sum()) - len(graph.wrapper.expected_allocs), 0)
        return CallJoin(key, role, thread, begin, end, len(alloc_pos), "kernel", reason, unseen)
    assert graph is not None
    # a training loop calls each graph the same way every step: a call whose allocations nest, live
    # and die as an earlier call's did gets that call's labels (a dict lookup, not a pass in Python)
    same = _call_shape(ctx, n, alloc_pos, freed_in_bw, key, interrupted)
    done = ctx.call_labels.get(same)
    if done is None:
        label_buffers(ctx, n, alloc_pos, graph, plan, tag, freed_in_bw, interrupted)
        ctx.call_labels[same] = (ctx.category[alloc_pos], ctx.node[alloc_pos], ctx.layer[alloc_pos],
                                 ctx.kernel[alloc_pos])
    else:
        ctx.category[alloc_pos], ctx.node[alloc_pos], ctx.layer[alloc_pos], ctx.kernel[alloc_pos] = done
    return CallJoin(key, role, thread, begin, end, len(alloc_pos), "buffer",
                    "the call was cut short (an OOM, or the capture's end): joined up to where it stopped"
                    if interrupted else "")
