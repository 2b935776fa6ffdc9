"""Labels of the blocks carried into a step window or a ring: those live where the stored steps begin,
allocated before them. A full capture labels each from the scopes around its allocation (the
compiled-graph call and wrapper buffer it came from, the optimizer step, the backward); the carried
block keeps those scopes (`CarriedBlock.path`: each scope's id and occurrence, and the block's
ordinal among the allocations made directly in the innermost), so it is labelled here by the same
rules (`join.CallLabeller`, `attribution.eager_category`) as the full capture labels it. A block
whose scopes cannot be matched to its graph's wrapper the way a full capture's join would is
labelled at kernel level, as a call that does not verify is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from memprof._events import CarriedBlock
from memprof.analysis.join import CallLabeller, call_tag, kernel_level_category
from memprof.analysis.labels import Category, LabelContext
from memprof.analysis.units import block_fits

GRAPH_CALL = "## Call CompiledFxGraph "

EagerCategory = Callable[[int, bool, bool], Category]


def label_carried(ctx: LabelContext, blocks: Sequence[CarriedBlock], in_backward: np.ndarray,
                  freed_in_bw: np.ndarray, eager: EagerCategory, optimizer_scopes: tuple[str, ...],
                  backward_scopes: tuple[str, ...]) -> None:
    """Relabel the carried allocations of this device's timeline from their scopes. `eager(pos,
    in_optimizer, in_backward)`: the category an eager allocation at timeline position `pos` takes."""
    tl = ctx.tl
    for block in blocks:
        pos = int(np.searchsorted(tl.rows, block.row))
        if pos >= len(tl.rows) or int(tl.rows[pos]) != block.row or not tl.is_alloc[pos]:
            continue  # (another device's block)
        names = [ctx.strings[s] if s < len(ctx.strings) else "" for s, _occ in block.path]
        call = next((i for i, n in enumerate(names) if n.startswith(GRAPH_CALL)), None)
        if call is None:
            in_opt = any(n.startswith(optimizer_scopes) for n in names)
            in_bw = bool(in_backward[pos]) or any(n.startswith(backward_scopes) for n in names)
            kern = ctx.names.names[int(ctx.kernel[pos])]
            ctx.set(pos, eager(pos, in_opt, in_bw), ctx.names.names[int(ctx.node[pos])], "", kern)
            continue
        _label_in_call(ctx, block, names, call, pos, bool(freed_in_bw[pos]))


def _label_in_call(ctx: LabelContext, block: CarriedBlock, names: list[str], call: int, pos: int,
                   freed_in_bw: bool) -> None:
    """A carried block made inside a compiled-graph call: it outlived the call (it is live after it)."""
    key = names[call][len(GRAPH_CALL):].removesuffix(" ##")
    graph = ctx.graphs.get(key)
    plan = ctx.plans.get(graph.plan) if graph is not None and graph.plan is not None else None
    tag = call_tag(graph, plan)
    direct = call == len(names) - 1
    child = names[call + 1] if not direct else ""
    wrapper = graph.wrapper if graph is not None else None
    if graph is not None and wrapper is not None and not graph.notes and not wrapper.unsupported:
        labeller = CallLabeller.of(ctx, graph, plan, tag)
        if direct:
            expected = wrapper.expected_allocs
            d = block.ordinal
            if d < len(expected) and (expected[d].nbytes is None or block_fits(
                    expected[d].nbytes, int(ctx.tl.delta_at(pos)), ctx.tl.device == "cpu")):
                labeller.direct(pos, expected[d].buf, True, freed_in_bw)
                return
        else:
            named = {c.scope for c in wrapper.calls if c.scope is not None}
            if child in named:  # the k-th scope of a name is the wrapper's k-th call of it
                calls = wrapper.calls_by_scope.get(child, [])
                occurrence = block.path[call + 1][1]
                labeller.in_child(pos, child, calls[occurrence] if occurrence < len(calls) else None, False, True,
                                  freed_in_bw)
                return
            if not any(n in named for n in names[call + 1:]):
                labeller.unopened(pos, names[-1], True)
                return
    role = graph.role if graph is not None else "unknown"
    kern = child or "(wrapper allocation)"
    ctx.set(pos, kernel_level_category(role, not direct, False, True, freed_in_bw), f"{tag}:{kern}", "", kern)
