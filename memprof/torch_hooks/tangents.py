"""The gradients a prediction's first compiled backward would be handed: what decides, on torch 2.11,
which of its tangents the autograd engine holds through the backward (`memprof.sweep.predict`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class _Reached(Exception):
    """A compiled region's backward was reached (`incoming_tangents`)."""


def incoming_tangents(roots: Sequence[Any]) -> list[tuple[list[int], str, bool]] | None:
    """The gradients the first compiled region's backward a backward from `roots` reaches would be
    handed, as (shape, dtype, contiguous), in output order (an output handed none left out); found by
    running the backward's eager part (the ops between the loss and the region: `.sum()`'s expand,
    say) and stopping where the region's backward would start. AOTAutograd copies a gradient that is
    not contiguous, and the copy goes at the wrapper's `del`; one it takes as it is, torch 2.11's
    engine holds to the call's end (`memprof.sweep.step_estimate.kept_tangents`). None where the
    roots are not scalars (a gradient the script passes is not known here) or no region is reached."""
    import torch
    from torch.autograd.graph import _engine_run_backward

    if not roots or any(not isinstance(r, torch.Tensor) or r.numel() != 1 or r.grad_fn is None for r in roots):
        return None
    regions, frontier, seen = [], [r.grad_fn for r in roots], set()
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            regions.append(node)
        else:
            frontier.extend(n for n, _i in node.next_functions)
    got: list[tuple[list[int], str, bool] | None] = []

    def reached(grads: Sequence[Any]) -> None:
        got.extend((list(g.shape), str(g.dtype).removeprefix("torch."), bool(g.is_contiguous()))
                   if isinstance(g, torch.Tensor) else None for g in grads)
        raise _Reached

    handles = [node.register_prehook(reached) for node in regions]
    try:
        _engine_run_backward(tuple(roots), tuple(torch.ones_like(r) for r in roots), True, False, (), True, True)
    except _Reached:
        return [g for g in got if g is not None]
    except Exception:  # (any other failure: nothing known, the version's rule stands)
        return None
    finally:
        for h in handles:
            h.remove()
    return None
