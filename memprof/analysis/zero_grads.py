"""Zeros autograd makes as the gradients of compiled outputs that no loss used.

A compiled region runs as one autograd Function. When the backward reaches it, the engine hands it
a gradient for every output that requires one; for an output that no loss term reached (a model's
logits, returned beside the loss computed from them) the Function is handed zeros the size of that
output (`ctx.set_materialize_grads`, on by default; AOTAutograd turns it off only for outputs that
are not differentiable). They are made by `aten::zeros` directly under `CompiledFunctionBackward`,
before the compiled backward runs, and live while it runs: for a language model, a tensor the size
of its logits. A compiled function that returns the loss alone (the logits then inside the graph)
is handed none.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from memprof.analysis.labels import LabelContext, Labels
from memprof.analysis.scopes import ScopeIndex, inside
from memprof.analysis.timeline import Timeline

ZERO_GRAD_NODE = "eager:zeros as the gradient of an unused output"
_FUNCTION = "CompiledFunctionBackward"
_ZEROS = ("aten::zeros", "aten::zeros_like")

ADVICE = ("zeros autograd made as the gradients of compiled-graph outputs that no loss used (e.g. logits "
          "returned beside the loss); compiling a function that returns only the loss makes none")


def zero_grad_calls(scopes: ScopeIndex, scope_id: Mapping[str, int]) -> list[tuple[int, int, int, int]]:
    """(thread, begin row, end row, scope) of each `aten::zeros` called directly under a
    `CompiledFunctionBackward` scope, sorted by thread and row. Op scopes show them; a capture
    recorded with fewer scopes has none."""
    zeros = {i for s, i in scope_id.items() if s in _ZEROS}
    functions = [i for s, i in scope_id.items() if s == _FUNCTION]
    if not zeros or not functions:
        return []
    out: list[tuple[int, int, int, int]] = []
    for thread, begin, end, _scope in scopes.outermost(functions):
        child_b, child_e, child_s = scopes.children(thread, begin, end, None)
        hit = np.isin(child_s, list(zeros))
        out += [(thread, b, e, s) for b, e, s in zip(child_b[hit].tolist(), child_e[hit].tolist(),
                                                     child_s[hit].tolist(), strict=True)]
    return sorted(out)


def label_zero_grads(ctx: LabelContext, eager: np.ndarray) -> None:
    """Name the eager allocations (timeline positions `eager`) made by those zeros `ZERO_GRAD_NODE`."""
    calls = zero_grad_calls(ctx.scopes, ctx.scope_id)
    if calls:
        made = eager[inside(ctx.tl.rows[eager], ctx.thread[eager], calls) >= 0]
        ctx.node[made] = ctx.names(ZERO_GRAD_NODE)


def zero_grad_bytes(labels: Labels, tl: Timeline, live: np.ndarray) -> int:
    """Bytes of such zeros among the live allocations at timeline positions `live`."""
    if ZERO_GRAD_NODE not in labels.names:
        return 0
    mine = live[labels.node[live] == labels.names.index(ZERO_GRAD_NODE)]
    return int(tl.delta_at(mine).sum())
