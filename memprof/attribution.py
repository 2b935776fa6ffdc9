"""Attribution: what every captured allocation is, which FX node and layer made it, and why it is live.

Pure analysis over the event array, a device timeline and the compile plans (no torch, no I/O).

Inside each compiled-graph call (`## Call CompiledFxGraph <key> ##` scope) the runtime
allocations are joined to the graph's wrapper code: allocations the wrapper makes itself
(no nested scope) are its `empty_strided_*` buffers, in order; allocations inside a nested
scope belong to that extern call or kernel launch, matched by name and occurrence. The join
is verified on every call (count and byte size of each allocation); a call that does not
verify, or a graph whose wrapper cannot be joined (cpp_wrapper, CUDA graphs, memory
planning, a graph compiled before the capture), is attributed at kernel level and reported
as such. Buffers lead to FX nodes (Inductor's own origins) and to the plan: forward outputs
after `num_fwd_outputs` are saved activations, backward buffers computed by nodes that also
exist in the forward are recomputed, boolean values drawn from random ops are RNG masks.
Allocations outside compiled graphs are classified from their eager scope and lifetime;
known parameters, gradients and optimizer state (recorded by ptr) take precedence.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from memprof._events import FLAG_OTHER_THREAD, Kind
from memprof.plans import CompiledGraph, Plan, layer_of
from memprof.timeline import Timeline
from memprof.wrapper_code import block_fits, check_symbolic_sizes


class Category(enum.IntEnum):
    """Why an allocation exists (a refinement of torch.profiler's memory categories)."""

    PARAMETER = 0
    GRADIENT = 1
    OPTIMIZER_STATE = 2
    INPUT = 3
    SAVED_ACTIVATION = 4
    RECOMPUTED = 5
    RNG_MASK = 6  # dropout masks, and the random values or seeds they come from
    TEMPORARY = 7
    WORKSPACE = 8
    UNATTRIBUTED = 9


CATEGORIES = tuple(c.name.lower() for c in Category)
BY = ("category", "node", "layer", "kernel")
BEFORE_CAPTURE = "(allocated before the capture)"
_CATEGORY_OF_KNOWN = {"parameter": Category.PARAMETER, "gradient": Category.GRADIENT,
                      "optimizer_state": Category.OPTIMIZER_STATE}


@dataclass(frozen=True)
class CallJoin:
    """How one compiled-graph call was attributed."""

    key: str
    role: str  # forward, backward, inference, unknown
    thread: int
    begin_row: int
    end_row: int
    allocations: int
    level: str  # "buffer" (joined and verified) or "kernel"
    reason: str = ""  # why the call fell back to kernel level


@dataclass(frozen=True)
class Labels:
    """Per timeline position: category and label ids (frees carry their allocation's labels)."""

    category: np.ndarray
    node: np.ndarray
    layer: np.ndarray
    kernel: np.ndarray
    names: list[str]
    calls: list[CallJoin] = field(default_factory=list)
    # blocks live when the capture started (CUDA snapshot): size, position of their free
    # (len(timeline) if never freed), and labels like the arrays above
    pre_size: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pre_free: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pre_category: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    pre_node: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    pre_layer: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    pre_kernel: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def label(self, by: str) -> np.ndarray:
        return {"node": self.node, "layer": self.layer, "kernel": self.kernel}[by]

    def pre_label(self, by: str) -> np.ndarray:
        return {"node": self.pre_node, "layer": self.pre_layer, "kernel": self.pre_kernel}[by]


@dataclass(frozen=True)
class AttributionRow:
    key: str
    bytes: int
    count: int
    share: float  # of the live bytes at that point
    category: str  # the category (for by=category: the key itself; else the largest one in the row)


class _Interner:
    def __init__(self) -> None:
        self.names: list[str] = [""]
        self.ids: dict[str, int] = {"": 0}

    def __call__(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.names)
            self.names.append(name)
        return i


def _intervals(raw: np.ndarray, scope_ids: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(thread, begin_row, end_row, scope) of the given scopes, outermost per nesting; open ones end at len(raw)."""
    if not len(scope_ids):
        return []
    kinds = raw["kind"]
    rows = np.flatnonzero(np.isin(raw["scope"], np.asarray(scope_ids, dtype=raw["scope"].dtype))
                          & ((kinds == Kind.SCOPE_BEGIN) | (kinds == Kind.SCOPE_END)))
    stacks: dict[int, list[tuple[int, int]]] = defaultdict(list)
    out: list[tuple[int, int, int, int]] = []
    for row, kind, thread, scope in zip(rows.tolist(), kinds[rows].tolist(), raw["thread"][rows].tolist(),
                                        raw["scope"][rows].tolist(), strict=True):
        stack = stacks[thread]
        if kind == Kind.SCOPE_BEGIN:
            stack.append((scope, row))
            continue
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] == scope:
                if i == 0:
                    out.append((thread, stack[0][1], row, scope))
                del stack[i:]
                break
    for thread, stack in stacks.items():
        if stack:
            out.append((thread, stack[0][1], len(raw), stack[0][0]))
    out.sort(key=lambda x: (x[0], x[1]))
    return out


def _inside(rows: np.ndarray, threads: np.ndarray, intervals: list[tuple[int, int, int, int]]) -> np.ndarray:
    """Index of the interval containing each (row, thread), -1 if none (intervals do not overlap per thread)."""
    out = np.full(len(rows), -1, dtype=np.int64)
    if not intervals:
        return out
    arr = np.asarray(intervals, dtype=np.int64)
    for thread in np.unique(arr[:, 0]).tolist():
        sel = np.flatnonzero(arr[:, 0] == thread)
        begins, ends = arr[sel, 1], arr[sel, 2]
        mask = threads == thread
        r = rows[mask]
        j = np.searchsorted(begins, r, side="right") - 1
        ok = (j >= 0) & (r < ends[np.maximum(j, 0)])
        res = np.full(len(r), -1, dtype=np.int64)
        res[ok] = sel[j[ok]]
        out[mask] = res
    return out


class _Context:
    """Shared inputs of the labelling passes."""

    def __init__(self, raw: np.ndarray, strings: Sequence[str], tl: Timeline, plans: Sequence[Plan],
                 graphs: Sequence[CompiledGraph], main_thread: int | None) -> None:
        self.raw, self.strings, self.tl = raw, strings, tl
        self.plans = {p.index: p for p in plans}
        self.graphs = {g.key: g for g in graphs}
        self.main_thread = main_thread
        n = len(tl.rows)
        self.n = n
        self.names = _Interner()
        self.scope_id = {name: i for i, name in enumerate(strings)}
        self.category = np.full(n, Category.UNATTRIBUTED, dtype=np.int8)
        self.node = np.zeros(n, dtype=np.int32)
        self.layer = np.zeros(n, dtype=np.int32)
        self.kernel = np.zeros(n, dtype=np.int32)
        self.labelled = np.zeros(n, dtype=bool)
        self.thread = raw["thread"][tl.rows].astype(np.int64)
        self.free_row = np.where(tl.free_of >= 0, tl.rows[np.maximum(tl.free_of, 0)], len(raw)).astype(np.int64)
        self.free_thread = np.where(tl.free_of >= 0, self.thread[np.maximum(tl.free_of, 0)], -1)
        # scope events per thread, for nesting inside graph calls
        kinds = raw["kind"]
        scope_rows = np.flatnonzero((kinds == Kind.SCOPE_BEGIN) | (kinds == Kind.SCOPE_END))
        self.scope_rows: dict[int, np.ndarray] = {}
        sthreads = raw["thread"][scope_rows]
        for t in np.unique(sthreads).tolist():
            self.scope_rows[int(t)] = scope_rows[sthreads == t]

    def set(self, pos: np.ndarray | int, category: int, node: str = "", layer: str = "", kernel: str = "") -> None:
        self.category[pos] = category
        self.node[pos] = self.names(node)
        self.layer[pos] = self.names(layer)
        self.kernel[pos] = self.names(kernel)
        self.labelled[pos] = True


def _node_layer(plan: Plan | None, role: str, *names: str) -> str:
    """The layer of the first of `names` (an FX node and its fallbacks) whose module is known."""
    if plan is None:
        return ""
    graph = plan.backward if role == "backward" else plan.forward
    for name in names:
        node = graph.by_name.get(name) or plan.forward.by_name.get(name)
        if node is not None and node.module_path:
            return layer_of(node.module_path)
    return ""


def _join_call(ctx: _Context, thread: int, begin: int, end: int, key: str,
               alloc_pos: np.ndarray, freed_in_backward: np.ndarray) -> CallJoin:
    raw, strings, tl = ctx.raw, ctx.strings, ctx.tl
    graph = ctx.graphs.get(key)
    role = graph.role if graph is not None else "unknown"
    rows = tl.rows[alloc_pos]
    # Allocations the wrapper makes itself open no scope: their innermost scope is the call's.
    call_scope = int(raw["scope"][begin])
    is_direct = raw["scope"][rows] == call_scope
    # Top-level scopes of the call that the wrapper opens (extern ops, kernel launches). Only
    # scopes named in the wrapper count: others (autotuning on a first call, for one) may
    # begin without a matching end on this thread and would hide the nesting.
    srows = ctx.scope_rows.get(thread, np.zeros(0, np.int64))
    lo, hi = np.searchsorted(srows, begin, side="right"), np.searchsorted(srows, end, side="left")
    inner = srows[lo:hi]
    if graph is not None:
        names = {c.scope for c in graph.wrapper.calls if c.scope is not None}
        ids = [ctx.scope_id[n] for n in names if n in ctx.scope_id]
        inner = inner[np.isin(raw["scope"][inner], np.asarray(ids, dtype=raw["scope"].dtype))]
    step = np.where(raw["kind"][inner] == Kind.SCOPE_BEGIN, 1, -1)
    depth = np.cumsum(step)
    top_begin = np.flatnonzero((step == 1) & (depth == 1))
    closes = np.flatnonzero(depth == 0)
    j = np.searchsorted(closes, top_begin)
    child_b = inner[top_begin]
    if len(closes):
        child_e = np.where(j < len(closes), inner[closes[np.minimum(j, len(closes) - 1)]], end)
    else:
        child_e = np.full(len(top_begin), end, dtype=np.int64)
    child_scope = raw["scope"][child_b]
    k = np.searchsorted(child_b, rows, side="right") - 1
    child_end = child_e[np.maximum(k, 0)] if len(child_b) else np.full(len(rows), -1, dtype=np.int64)
    in_child = ~is_direct & (k >= 0) & (rows < child_end)
    child_of = np.where(in_child, k, -1)
    free_row = ctx.free_row[alloc_pos]
    survives_call = free_row > end
    freed_in_child = in_child & (free_row < child_end)
    freed_in_bw = freed_in_backward[alloc_pos]
    plan = ctx.plans.get(graph.plan) if graph is not None and graph.plan is not None else None
    tag = {"forward": "fw", "backward": "bw", "inference": "inf"}.get(role, "graph")
    tag = f"{tag}{plan.index}" if plan is not None else tag

    def child_name(c: int) -> str:
        return strings[int(child_scope[c])] if c >= 0 else ""

    reason = ""
    direct = np.flatnonzero(is_direct)
    if graph is None:
        reason = "no compile plan for this graph (compiled before the capture started?)"
    elif graph.notes:
        reason = ", ".join(graph.notes)
    elif graph.wrapper.unsupported:
        reason = ", ".join(graph.wrapper.unsupported)
    else:
        expected = graph.wrapper.expected_allocs
        if len(direct) != len(expected):
            reason = f"{len(direct)} wrapper allocations at run time, {len(expected)} in the wrapper code"
        else:
            cpu = tl.device == "cpu"
            sizes = tl.delta[alloc_pos[direct]].tolist()
            for alloc, size in zip(expected, sizes, strict=True):
                if not block_fits(alloc.nbytes, int(size), cpu):
                    reason = f"{alloc.buf}: {size} bytes allocated, {alloc.nbytes} expected"
                    break
            else:  # symbolic sizes (dynamic shapes): some values of the size symbols explain them all
                reason = check_symbolic_sizes(
                    [(a, int(b)) for a, b in zip(expected, sizes, strict=True) if a.nbytes is None], cpu)

    if reason:  # kernel level: categories from lifetimes only
        for i in range(len(alloc_pos)):
            kern = child_name(int(child_of[i])) or (strings[int(raw["scope"][rows[i]])] if not is_direct[i]
                                                     else "(wrapper allocation)")
            if freed_in_child[i] or (in_child[i] and not survives_call[i] and role != "backward"):
                cat = Category.WORKSPACE if freed_in_child[i] else Category.TEMPORARY
            elif not survives_call[i]:
                cat = Category.TEMPORARY
            elif role == "backward":
                cat = Category.GRADIENT
            elif freed_in_bw[i]:
                cat = Category.SAVED_ACTIVATION
            else:
                cat = Category.TEMPORARY
            ctx.set(alloc_pos[i], cat, f"{tag}:{kern}", "", kern)
        return CallJoin(key, role, thread, begin, end, len(alloc_pos), "kernel", reason)

    assert graph is not None
    wrapper = graph.wrapper
    nfo = plan.num_fwd_outputs if plan is not None else len(wrapper.outputs)
    out_positions: dict[str, list[int]] = defaultdict(list)
    for i, o in enumerate(wrapper.outputs):
        if o is not None:
            out_positions[o].append(i)
    by_scope = wrapper.calls_by_scope
    seen: dict[str, int] = defaultdict(int)
    call_of_child: list[int | None] = []
    for child in range(len(child_b)):
        name = child_name(child)
        occ = seen[name]
        seen[name] += 1
        cands = by_scope.get(name, [])
        call_of_child.append(cands[occ] if occ < len(cands) else None)
    # dropout randomness: boolean masks and the random values (or seeds) they are drawn from
    masks = set(plan.masks) | set(plan.random_ops) if plan is not None else set()
    recomputed = set(plan.recomputed) if plan is not None else set()
    expected = wrapper.expected_allocs
    d = 0
    for i in range(len(alloc_pos)):
        pos = alloc_pos[i]
        if not in_child[i] and not is_direct[i]:  # inside a scope the wrapper does not open (autotuning)
            kern = strings[int(raw["scope"][rows[i]])]
            cat = Category.WORKSPACE if not survives_call[i] else Category.TEMPORARY
            ctx.set(pos, cat, f"{tag}:{kern}", "", kern)
            continue
        if is_direct[i]:
            root = expected[d].buf
            d += 1
            writer = wrapper.writer.get(root)
            writer_call = wrapper.calls[writer] if writer is not None else None
            kern = (writer_call.scope or writer_call.kernel) if writer_call is not None else "(no kernel)"
        else:
            c = int(child_of[i])
            ci = call_of_child[c]
            kern = child_name(c)
            site = wrapper.calls[ci] if ci is not None else None
            if site is None or site.out is None or freed_in_child[i]:
                nodes = graph.origins.get(site.out or "", []) if site is not None else []
                if not nodes and site is not None:
                    nodes = [n for a in site.args for n in graph.origins.get(wrapper.root(a), [])[-1:]]
                node = nodes[-1] if nodes else kern
                ctx.set(pos, Category.WORKSPACE, f"{tag}:{node}", _node_layer(plan, role, *nodes[::-1]), kern)
                continue
            root = site.out
        origins = graph.origins.get(root, [])
        primary = origins[-1] if origins else root
        positions = out_positions.get(root, [])
        saved = [plan.saved[p - nfo] for p in positions if plan is not None and nfo <= p < nfo + len(plan.saved)]
        if role == "forward" and saved:
            node = saved[0]
            cat = Category.RNG_MASK if any(s in masks for s in saved) else Category.SAVED_ACTIVATION
        elif not survives_call[i]:
            node = primary
            if role == "backward" and primary in recomputed:
                cat = Category.RNG_MASK if primary in masks else Category.RECOMPUTED
            else:
                cat = Category.TEMPORARY
        elif role == "backward":
            node, cat = primary, Category.GRADIENT
        else:
            node = primary
            cat = Category.SAVED_ACTIVATION if freed_in_bw[i] else Category.TEMPORARY
        ctx.set(pos, cat, f"{tag}:{node}", _node_layer(plan, role, node, *origins[::-1]), kern)
    return CallJoin(key, role, thread, begin, end, len(alloc_pos), "buffer")


def label_timeline(
    raw: np.ndarray,
    strings: Sequence[str],
    tl: Timeline,
    plans: Sequence[Plan] = (),
    graphs: Sequence[CompiledGraph] = (),
    tensors: Sequence[tuple[int, str, int, int, str, str]] = (),
    main_thread: int | None = None,
    preexisting: Sequence[tuple[int, int]] = (),
) -> Labels:
    """Category, FX node, layer and kernel of every allocation on one device's timeline.

    `preexisting` are (ptr, bytes) of the blocks live when the capture started (CUDA).
    """
    ctx = _Context(raw, strings, tl, plans, graphs, main_thread)
    alloc_pos = np.flatnonzero(tl.is_alloc)
    rows = tl.rows[alloc_pos]
    threads = ctx.thread[alloc_pos]
    sid = {s: i for i, s in enumerate(strings)}
    graph_ids = [i for s, i in sid.items() if s.startswith("## Call CompiledFxGraph ")]
    backward_scopes = ("autograd::engine::evaluate_function", "CompiledFunctionBackward")
    bw_ids = [i for s, i in sid.items() if s.startswith(backward_scopes)]
    opt_ids = [i for s, i in sid.items() if s.startswith(("Optimizer.step#", "Optimizer.zero_grad#"))]
    grad_ids = {i for s, i in sid.items() if "AccumulateGrad" in s}

    calls = _intervals(raw, graph_ids)
    bws = _intervals(raw, bw_ids)
    opts = _intervals(raw, opt_ids)
    # "in backward": on an autograd worker thread, or inside a backward scope; CPU events of other
    # threads (intra-op workers, Python threads: FLAG_OTHER_THREAD) are not autograd's
    bw_of_event = _inside(tl.rows, ctx.thread, bws)
    autograd_thread = (raw["flags"][tl.rows] & FLAG_OTHER_THREAD) == 0
    in_backward = (bw_of_event >= 0) | ((ctx.thread != main_thread) & autograd_thread if main_thread is not None
                                              else np.zeros(ctx.n, bool))
    # frees: where did the allocation die?
    free_pos = tl.free_of
    freed_in_bw = np.zeros(ctx.n, dtype=bool)
    has_free = free_pos >= 0
    freed_in_bw[has_free] = in_backward[free_pos[has_free]]

    joins: list[CallJoin] = []
    call_of = _inside(rows, threads, calls)
    if calls:
        order = np.argsort(call_of, kind="stable")
        sorted_calls = call_of[order]
        starts = np.searchsorted(sorted_calls, np.arange(len(calls)), side="left")
        ends = np.searchsorted(sorted_calls, np.arange(len(calls)), side="right")
        for ci, (thread, b, e, scope) in enumerate(calls):
            key = strings[scope][len("## Call CompiledFxGraph "):].removesuffix(" ##")
            members = alloc_pos[order[starts[ci]:ends[ci]]]
            joins.append(_join_call(ctx, thread, b, e, key, members, freed_in_bw))

    # eager allocations
    eager = alloc_pos[call_of < 0]
    if len(eager):
        erows = tl.rows[eager]
        ethreads = ctx.thread[eager]
        escope = raw["scope"][erows]
        scope_names = np.asarray(strings, dtype=object)[escope]
        in_opt = _inside(erows, ethreads, opts)
        opt_end = np.asarray([o[2] for o in opts], dtype=np.int64)
        first_activity = min([c[1] for c in calls] + [b[1] for b in bws] + [len(raw)])
        steps = np.flatnonzero(raw["kind"] == Kind.STEP)
        free_row = ctx.free_row[eager]
        spans_step = (np.searchsorted(steps, free_row) - np.searchsorted(steps, erows)) > 0
        is_grad = np.isin(escope, np.asarray(sorted(grad_ids), dtype=escope.dtype))
        bw_here = in_backward[eager]
        for i, pos in enumerate(eager.tolist()):
            kern = scope_names[i] or "(no scope)"
            if in_opt[i] >= 0:
                cat = Category.OPTIMIZER_STATE if free_row[i] > opt_end[in_opt[i]] else Category.TEMPORARY
            elif is_grad[i]:
                cat = Category.GRADIENT
            elif bw_here[i]:
                cat = Category.TEMPORARY
            elif freed_in_bw[pos]:
                cat = Category.SAVED_ACTIVATION
            elif erows[i] < first_activity or spans_step[i]:
                cat = Category.INPUT
            else:
                cat = Category.TEMPORARY
            ctx.set(pos, cat, f"eager:{kern}", "", kern)

    # known tensors (parameters, gradients, optimizer state) override by pointer and time
    if tensors:
        _apply_known(ctx, tensors, alloc_pos)

    # frees carry their allocation's labels
    f = np.flatnonzero(has_free)
    src = free_pos[f]
    # free_of maps alloc -> free; copy alloc labels to the free positions
    for arr in (ctx.category, ctx.node, ctx.layer, ctx.kernel):
        arr[src] = arr[f]
    pre = _label_preexisting(ctx, preexisting, tensors)
    return Labels(ctx.category, ctx.node, ctx.layer, ctx.kernel, ctx.names.names, joins, *pre)


def _label_preexisting(ctx: _Context, blocks: Sequence[tuple[int, int]],
                       tensors: Sequence[tuple[int, str, int, int, str, str]]) -> tuple[np.ndarray, ...]:
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
        t_free = int(tl.t_ns[free[i]]) if free[i] < ctx.n else np.iinfo(np.int64).max
        for t_ns, category, name in known.get(ptr, []):
            c = _CATEGORY_OF_KNOWN.get(category)
            if c is not None and t_ns < t_free:
                cat[i], node[i], layer[i] = c, ctx.names(f"{category}:{name}"), ctx.names(_known_layer(name))
                break
        if free[i] < ctx.n:
            ctx.category[free[i]], ctx.node[free[i]] = cat[i], node[i]
            ctx.layer[free[i]], ctx.kernel[free[i]] = layer[i], kernel[i]
    return size, free, cat, node, layer, kernel


def _apply_known(ctx: _Context, tensors: Sequence[tuple[int, str, int, int, str, str]], alloc_pos: np.ndarray) -> None:
    tl = ctx.tl
    mine = [t for t in tensors if t[1] == tl.device]
    if not mine or not len(alloc_pos):
        return
    ptrs = ctx.raw["ptr"][tl.rows[alloc_pos]].astype(np.uint64)
    t_alloc = tl.t_ns[alloc_pos]
    t_free = np.where(tl.free_of[alloc_pos] >= 0, tl.t_ns[np.maximum(tl.free_of[alloc_pos], 0)], np.iinfo(np.int64).max)
    order = np.lexsort((t_alloc, ptrs))
    sp, st = ptrs[order], t_alloc[order]
    for t_ns, _device, ptr, _nbytes, category, name in mine:
        lo = np.searchsorted(sp, np.uint64(ptr), side="left")
        hi = np.searchsorted(sp, np.uint64(ptr), side="right")
        if lo == hi:
            continue
        j = lo + np.searchsorted(st[lo:hi], t_ns, side="right") - 1
        if j < lo:
            continue
        a = order[j]
        if t_free[a] <= t_ns:
            continue
        pos = alloc_pos[a]
        cat = _CATEGORY_OF_KNOWN.get(category)
        if cat is None:
            continue
        ctx.set(pos, cat, f"{category}:{name}", _known_layer(name), ctx.names.names[ctx.kernel[pos]])


def _known_layer(name: str) -> str:
    """The layer of a known tensor ("layers.3.mlp.w.exp_avg" -> "layers.3"; unnamed ones: "")."""
    base = name.removesuffix(".grad").split(".exp_avg")[0].split(".step")[0]
    return "" if base.startswith("param_groups") else layer_of(base)


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
    sizes = tl.delta[live]
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
    cats = labels.category.astype(np.int64)
    for c in range(len(CATEGORIES)):
        sel = cats == c
        if sel.any():
            out[:, c] = np.cumsum(np.where(sel, tl.delta, 0))[idx]
    start = np.zeros(len(CATEGORIES), dtype=np.int64)
    start[Category.UNATTRIBUTED] = tl.baseline
    if len(labels.pre_size) and int(labels.pre_size.sum()) <= tl.baseline:
        np.add.at(start, labels.pre_category.astype(np.int64), labels.pre_size)
        start[Category.UNATTRIBUTED] -= int(labels.pre_size.sum())
    return out + start
