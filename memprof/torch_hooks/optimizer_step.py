"""What an optimizer's first step will allocate, read from the live optimizers before it runs (a
prediction stops at the first backward): the state it makes and keeps, and the temporaries it
makes and frees, in the order torch's Adam, AdamW and SGD make them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memprof.analysis.caching_allocator import OptimizerStep


def optimizer_state_bytes(device_type: str) -> int:
    """What the first step of each live optimizer allocates on `device_type` for its state, as
    `optimizer_state_requests` counts it (optimizers it does not know count nothing), in the CUDA
    caching allocator's 512-byte blocks there."""
    import torch

    from memprof.analysis.caching_allocator import round_size

    if device_type == "cuda":
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return 0
        return sum(round_size(r) for r in optimizer_state_requests(torch.cuda.current_device())[0].state)
    return sum(optimizer_state_requests(-1)[0].state)


def optimizer_state_requests(device: int) -> tuple[OptimizerStep, list[str]]:
    """What the first step of each live optimizer allocates on CUDA device `device` (-1: on the CPU),
    in the order it does: its state (Adam and AdamW: per parameter the step count where it lives on the device
    (fused or capturable), exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad; SGD: a momentum
    buffer where momentum is set) and the temporaries it frees before it ends (`adam_temporaries`);
    and the names of optimizers whose step is not known this way. Parameters whose state exists
    already (a step ran) allocate nothing."""
    if device < 0:  # (the CPU)
        return _state_requests(lambda p: p.device.type == "cpu")
    return _state_requests(lambda p: p.device.type == "cuda" and (p.device.index or 0) == device)


def _state_requests(here: Any) -> tuple[OptimizerStep, list[str]]:
    import torch

    from memprof.analysis.caching_allocator import OptimizerStep
    from memprof.torch_hooks.known_tensors import live_instances

    requests: list[int] = []
    transient: list[tuple[int, int]] = []
    unknown: set[str] = set()
    grads = 0
    for opt in live_instances(torch.optim.Optimizer):
        adam = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))
        for group in opt.param_groups:
            new = [p for p in group["params"] if p.requires_grad and here(p) and not opt.state.get(p)]
            grads += sum(p.numel() * p.element_size() for p in new)
            for p in new:
                nbytes = p.numel() * p.element_size()
                if adam:
                    requests += [4] if group.get("fused") or group.get("capturable") else []
                    requests += [nbytes] * (3 if group.get("amsgrad") else 2)
                elif isinstance(opt, torch.optim.SGD):
                    requests += [nbytes] if group.get("momentum") else []
                else:
                    unknown.add(type(opt).__name__)
            if adam and new:
                transient += adam_temporaries({**group, "foreach": _foreach(group, new)},
                                              [(p.dtype, p.numel() * p.element_size()) for p in new],
                                              isinstance(opt, torch.optim.AdamW)
                                              or bool(group.get("decoupled_weight_decay")), key=len(transient))
    return OptimizerStep(requests, transient, grads), sorted(unknown)


def _foreach(group: dict[str, Any], params: Sequence[Any]) -> bool | None:
    """Whether the group's step runs foreach: as set, else torch's default for these parameters
    (foreach on CUDA, one tensor at a time on the CPU)."""
    if group.get("foreach") is not None or group.get("fused"):
        return group.get("foreach")  # type: ignore[no-any-return]
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        return bool(_default_to_fused_or_foreach(list(params), bool(group.get("differentiable")), use_fused=False)[1])
    except (ImportError, TypeError):
        return None


def adam_temporaries(group: dict[str, Any], params: Sequence[tuple[object, int]], decoupled: bool,
                     key: int = 0) -> list[tuple[int, int]]:
    """The temporaries one Adam/AdamW parameter group's step allocates and frees, as (key, bytes)
    requests ((key, 0) freeing; keys from `key`), for its parameters' (dtype, bytes), in torch's
    order. Fused: none (one kernel). Foreach (CUDA's default): per dtype, the gradients' copy where
    `maximize` or coupled weight decay makes one (deleted before the next), the step sizes' and
    bias corrections' tensors where `capturable`, and `_foreach_sqrt` of every exp_avg_sq, live
    until the next dtype's are made. One tensor at a time (`foreach=False`): per parameter,
    `exp_avg_sq.sqrt()` and the denominator divided from it, the denominator live until the next
    one's."""
    out: list[tuple[int, int]] = []
    keys = itertools.count(key)

    def take(sizes: Sequence[int]) -> list[int]:
        made = [next(keys) for _ in sizes]
        out.extend(zip(made, sizes, strict=True))
        return made

    def drop(made: Sequence[int]) -> None:
        out.extend((k, 0) for k in made)

    if group.get("fused"):
        return out
    foreach = group.get("foreach")
    if foreach is None:
        foreach = not group.get("differentiable")
    if not foreach:
        held: list[int] = []
        for _dtype, nbytes in params:
            sqrt = take([nbytes])
            denominator = take([nbytes])
            drop(sqrt + held)
            held = denominator
        drop(held)
        return out
    by_dtype: dict[object, list[int]] = {}
    for dtype, nbytes in params:
        by_dtype.setdefault(dtype, []).append(nbytes)
    held = []
    for sizes in by_dtype.values():
        if group.get("maximize") or (group.get("weight_decay") and not decoupled):
            drop(take(sizes))
        temporaries = take([4] * (2 * len(sizes))) if group.get("capturable") else []
        temporaries += take(sizes)
        drop(held)
        held = temporaries
    drop(held)
    return out
