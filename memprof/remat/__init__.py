"""Use-site rematerialization with a liveness-aware saved set, for `torch.compile` training steps.

    import memprof.remat
    with memprof.remat.enable("all"):      # or "light"
        loss = compiled(batch); loss.backward()   # the first step compiles: keep it inside

Every forward/backward pair compiled inside the block is partitioned with memprof's pass:
the stock partitioner's saved set, made random-safe and extended by layer boundaries where
memprof's estimate says the peak falls, then use-site rematerialization of the backward
(`light`: pointwise ops, views, reductions; `all`: also matrix multiplies). Attention, random
ops, collectives, mutations and `*_backward` ops are never duplicated. Without the context
manager, set the partitioner yourself:

    torch._inductor.config.custom_partitioner_fn = memprof.remat.partitioner("all")   # Inductor
    aot_autograd(fw_compiler=..., partition_fn=memprof.remat.partition_fn("all"))     # others

`reports()` lists what the pass did for each graph compiled in this process.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from memprof.remat.report import RematReport
from memprof.remat.usesite import MODES
from memprof.torch_hooks.partition import Transforming, source_hash, transforming

__all__ = ["MODES", "RematReport", "active_mode", "enable", "partition_fn", "partitioner", "reports"]

_lock = threading.RLock()
_modes: list[str] = []


def _check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown remat mode {mode!r} (expected one of: {', '.join(MODES)})")
    return mode


def active_mode() -> str | None:
    """The mode of the innermost `enable` block, or None."""
    return _modes[-1] if _modes else None


def reports(clear: bool = False) -> list[RematReport]:
    """Reports of the graphs partitioned by the pass in this process (oldest first)."""
    from memprof.remat import fx

    return fx.reports(clear)


def _base(fn: Any) -> Callable[..., Any]:
    if fn is not None:
        return fn  # type: ignore[no-any-return]
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition  # type: ignore[no-any-return]


def _run(mode: str, base: Any, gm: Any, joint_inputs: Any, kwargs: dict[str, Any]) -> Any:
    from memprof.remat import fx

    return fx.partition(_base(base), gm, joint_inputs, mode, kwargs)


class RematPartitionFn(Transforming):
    """A `partition_fn` for `aot_autograd(...)`: `base` (default: min-cut) with memprof's pass."""

    def __init__(self, mode: str, base: Callable[..., Any] | None = None) -> None:
        self.mode = _check(mode)
        self.base = base
        self.__name__ = "memprof_remat_partition"

    def __call__(self, joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        return _run(self.mode, self.base, joint, joint_inputs, kwargs)


def partition_fn(mode: str, base: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A `partition_fn` for `aot_autograd(...)`: `base` (default: min-cut) with memprof's pass."""
    return RematPartitionFn(mode, base)


@functools.cache
def _partitioner_class() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class RematPartitioner(CustomPartitionerFn, Transforming):  # type: ignore[misc]
        """Inductor's `custom_partitioner_fn` running memprof's pass.

        Its `uuid()` names the mode and the pass's source, so Inductor's caches key on it: a stock
        compile and a pass compile never share an entry."""

        def __init__(self, mode: str) -> None:
            self.mode = mode

        def __call__(self, gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
            return _run(self.mode, None, gm, joint_inputs, kwargs)

        def __reduce__(self) -> tuple[Any, ...]:  # Inductor pickles its config for cache keys
            return _make_partitioner, (self.mode,)

        def uuid(self) -> str | None:
            return source_hash(f"remat:{self.mode}|None")

    return RematPartitioner


def _make_partitioner(mode: str) -> Any:
    return _partitioner_class()(mode)


def partitioner(mode: str) -> Any:
    """A `torch._inductor.config.custom_partitioner_fn` that runs memprof's pass in `mode`."""
    return _partitioner_class()(_check(mode))


@contextlib.contextmanager
def enable(mode: str | None = None, *, budget: str | float | None = None,
           search_budgets: Sequence[float] | None = None) -> Iterator[None]:
    """Every `torch.compile` that partitions a graph inside this block uses memprof's pass.

    The backward compiles lazily, at the first `.backward()`: keep the first training step inside.

    `budget`: the partitioner's activation memory budget inside the block, as a ratio (0.05,
    "0.05", 0 and 1 too) or as a size with its unit ("24GB", "22.5GiB"; never a bare number): the
    block then runs the configuration `memprof fit` would choose for this script under that peak
    (a stock budget, or one with the pass in `mode`, default light), predicted first from the
    script itself started again as `python SCRIPT ARGS` in other processes (stopping at their first
    backward, as `memprof sweep --predict`), among `search_budgets` (default
    `memprof.fit.DEFAULT_BUDGETS`). Under memprof's own commands, which set the budget themselves
    (`trace --budget`, `fit` and `sweep`), the block leaves theirs.
    """
    if budget is not None:
        with _budgeted(mode, budget, search_budgets):
            yield
        return
    if mode is None:
        raise TypeError("memprof.remat.enable needs a mode ('light' or 'all') or budget=")
    _check(mode)

    def transform(fn: Any, gm: Any, joint_inputs: Any, kwargs: dict[str, Any]) -> Any:
        return _run(mode, fn, gm, joint_inputs, kwargs)

    with _lock:
        _modes.append(mode)
    try:
        with transforming(f"remat:{mode}", transform):
            yield
    finally:
        with _lock:
            _modes.remove(mode)


@contextlib.contextmanager
def _budgeted(mode: str | None, budget: str | float, search: Sequence[float] | None) -> Iterator[None]:
    """`enable(mode, budget=...)`: the budget (and the pass, where the plan chose it) inside the block."""
    from memprof.analysis.units import checked_budget, parse_budget
    from memprof.torch_hooks.budget import budget_set, budget_set_by_memprof

    if mode is not None:
        _check(mode)
    if isinstance(budget, int) and not isinstance(budget, bool):
        # a number is a ratio, as torch's own budget and `trace --budget 1` read it (`budget=0`, as the
        # plan's own line prints it, is budget 0); a size is a string with its unit
        if budget not in (0, 1):
            raise ValueError(f"budget={budget!r}: a ratio is in [0, 1], a size a string with its unit "
                             f"(budget='{budget}GB', or '{budget}B' for bytes)")
        budget = float(budget)
    value = parse_budget(budget) if isinstance(budget, str) else checked_budget(budget, f"budget={budget!r}")
    if budget_set_by_memprof():  # memprof's command chose this process's configuration
        yield
        return
    if isinstance(value, float):  # a ratio: stock at it, or the pass at it
        with budget_set(value), (enable(mode) if mode else contextlib.nullcontext()):
            yield
        return
    from memprof.console import say
    from memprof.errors import MemprofError
    from memprof.fit import DEFAULT_BUDGETS, plan

    script = _running_script()
    try:
        config = plan(script, sys.argv[1:], value, mode, tuple(search or DEFAULT_BUDGETS),
                      asked="memprof.remat.enable(budget=...)")
    except MemprofError as exc:  # nothing to plan (no compiled training graph): the block runs as it is
        say(f"memprof: warning: {exc}; the block runs as it is")
        yield
        return
    pinned = ", ".join([*([repr(config.remat)] if config.remat else []), f"budget={config.budget:g}"])
    say(f"memprof: to run it again without the search: memprof.remat.enable({pinned})")
    with budget_set(config.budget), (enable(config.remat) if config.remat else contextlib.nullcontext()):
        yield


def _running_script() -> str:
    """The script this process runs as `python SCRIPT ARGS` (a budget in bytes is planned by starting
    it again)."""
    import __main__
    from memprof.errors import MemprofError

    path = getattr(__main__, "__file__", None)  # (`python -m pkg`: a module, not a script started again)
    if (not path or not str(path).endswith(".py") or getattr(__main__, "__spec__", None) is not None
            or not sys.argv or not sys.argv[0] or Path(sys.argv[0]).resolve() != Path(path).resolve()):
        raise MemprofError("enable(budget=SIZE) plans by starting this script again as `python SCRIPT ARGS`: call "
                           "it from a script run that way, or run `memprof fit SCRIPT --memory SIZE` and set the "
                           "budget and mode it prints")
    return str(Path(path).resolve())
