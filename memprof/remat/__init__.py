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
import threading
from collections.abc import Callable, Iterator
from typing import Any

from memprof.remat.report import RematReport
from memprof.remat.usesite import MODES

__all__ = ["MODES", "RematReport", "active_mode", "enable", "partition_fn", "partitioner", "reports"]

_lock = threading.RLock()
_modes: list[str] = []
_undo: list[Callable[[], None]] = []


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

    with fx._reports_lock:
        out = list(fx._reports)
        if clear:
            fx._reports.clear()
    return out


def _base(fn: Any) -> Callable[..., Any]:
    if fn is not None:
        return fn  # type: ignore[no-any-return]
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition  # type: ignore[no-any-return]


def partition_fn(mode: str, base: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A `partition_fn` for `aot_autograd(...)`: `base` (default: min-cut) with memprof's pass."""
    _check(mode)

    def fn(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        from memprof.remat import fx

        return fx.partition(_base(base), joint, joint_inputs, mode, kwargs)

    fn._memprof_remat = True  # type: ignore[attr-defined]
    return fn


@functools.cache
def _partitioner_class() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class RematPartitioner(CustomPartitionerFn):  # type: ignore[misc]
        """Inductor's `custom_partitioner_fn` running memprof's pass.

        Its `uuid()` names the mode and the pass's source, so Inductor's caches key on it: a stock
        compile and a pass compile never share an entry."""

        _memprof_remat = True

        def __init__(self, mode: str | None, inner: Any = None) -> None:
            self.mode = mode
            self.inner = inner

        def __call__(self, gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
            mode = self.mode or active_mode()
            inner = self.inner
            if mode is None or getattr(inner, "_memprof_recorder", False) or getattr(inner, "_memprof_remat", False):
                # off; or a capture's recorder is inside (it applies the pass and records the result);
                # or the user's own memprof partitioner is inside (it runs the pass once, in its mode)
                return _base(inner)(gm, joint_inputs, **kwargs)
            from memprof.remat import fx

            return fx.partition(_base(inner), gm, joint_inputs, mode, kwargs)

        def __reduce__(self) -> tuple[Any, ...]:  # Inductor pickles its config for cache keys
            return _make_partitioner, (self.mode, self.inner)

        def uuid(self) -> str | None:
            mode = self.mode or active_mode()
            inner = self.inner
            inner_id = None
            if inner is not None:
                inner_id = inner.uuid() if hasattr(inner, "uuid") else None
                if inner_id is None:
                    return None  # an uncacheable partitioner inside: no key at all
            return _source_hash(f"{mode}|{inner_id}")

    return RematPartitioner


def _make_partitioner(mode: str | None, inner: Any = None) -> Any:
    return _partitioner_class()(mode, inner)


@functools.cache
def _source_hash(salt: str) -> str:
    """sha256 of `salt` and memprof's Python source (the pass's decisions depend on nothing else)."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256(salt.encode())
    package = Path(__file__).resolve().parent.parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def partitioner(mode: str) -> Any:
    """A `torch._inductor.config.custom_partitioner_fn` that runs memprof's pass in `mode`."""
    return _partitioner_class()(_check(mode))


def _patch(obj: Any, name: str, value: Any) -> None:
    old = getattr(obj, name)
    setattr(obj, name, value)
    _undo.append(lambda: setattr(obj, name, old))


def _install() -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.backends.common import AotAutograd
    from torch._functorch.partitioners import default_partition

    _patch(inductor_config, "custom_partitioner_fn", _partitioner_class()(None, inductor_config.custom_partitioner_fn))
    # AOTAutograd's cache would return graphs partitioned before (no report); Inductor's FX graph and
    # kernel caches key on the partitioned graphs and stay on
    _patch(functorch_config, "enable_autograd_cache", False)
    original_call = AotAutograd.__call__

    def call(backend: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        fn = backend.kwargs.get("partition_fn", default_partition)
        module = getattr(getattr(fn, "func", fn), "__module__", "") or ""
        mode = active_mode()
        if (mode is None or module.startswith("torch._inductor") or getattr(fn, "_memprof_remat", False)
                or getattr(fn, "_memprof", False)):
            return original_call(backend, gm, example_inputs, **kwargs)
        clone = AotAutograd(**{**backend.kwargs, "partition_fn": partition_fn(mode, fn)})
        return original_call(clone, gm, example_inputs, **kwargs)

    _patch(AotAutograd, "__call__", call)


@contextlib.contextmanager
def enable(mode: str) -> Iterator[None]:
    """Every `torch.compile` that partitions a graph inside this block uses memprof's pass.

    The backward compiles lazily, at the first `.backward()`: keep the first training step inside.
    """
    _check(mode)
    with _lock:
        if not _modes:
            _install()
        _modes.append(mode)
    try:
        yield
    finally:
        with _lock:
            _modes.pop()
            if not _modes:
                while _undo:
                    _undo.pop()()
