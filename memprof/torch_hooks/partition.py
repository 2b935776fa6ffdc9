"""The one partitioner chain: every forward/backward partition torch.compile makes while memprof
is active runs through `run`, where the plan recorder observes and the remat pass transforms.

Inductor takes its partitioner from `torch._inductor.config.custom_partitioner_fn`, every other
AOTAutograd backend from its `partition_fn`; the chain wraps both once, however many memprof
features are active, and removes itself when the last one ends (in any order). The chain:
- runs the user's partitioner (the stock min-cut one when none is set), through the innermost
  active transform (`transforming`) unless the partitioner is itself one of memprof's own
  (`Transforming`: `memprof.remat.partitioner(...)`, `memprof.remat.partition_fn(...)`), which
  applies its pass itself;
- tells every observer (`observing`) what was partitioned, also when the partitioner failed;
- keeps Inductor's caches from skipping it unseen. AOTAutograd's cache (a hit skips tracing the
  joint graph and partitioning it) and Inductor's FX graph cache (a hit skips code generation) are
  off while an observer that cannot do without them is active (`observing(keeper=None)`: the
  chain's `uuid()` is then None). An observer that keeps its own record of what a hit skips (the
  capture's plan recorder, `memprof.graph_store`; `observing(keeper=...)`) leaves both on, with
  keys of memprof's own (the `uuid()` names memprof's source, and AOTAutograd's key includes it),
  so every hit is a graph memprof saw compiled; an AOTAutograd hit that a keeper has no record of
  is turned into a miss, so the graph compiles again and is recorded. A transform turns
  AOTAutograd's cache off; with only a transform, the FX graph key names the transform and
  memprof's source. Every other cache stays as the user has it: compiled kernels (C++, Triton) come
  from their caches, and Dynamo's profile-guided dynamism behaves as without memprof.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from memprof.torch_hooks.inductor import install_reuse_rule
from memprof.torch_hooks.patch import Patches, resolve

Partitioner = Callable[..., tuple[Any, Any]]
# (partitioner, joint graph, joint inputs, partitioner kwargs) -> (forward, backward)
Transform = Callable[[Partitioner, Any, Any, dict[str, Any]], tuple[Any, Any]]


class Transforming:
    """Base of memprof's own partitioners: the chain runs them as they are (their pass applies
    once, in their own mode) and only observes."""


GraphKeys = tuple[str | None, str | None]  # the FX graph cache keys of a pair's forward and backward


class RecordKeeper(Protocol):
    """Keeps its own record of what an AOTAutograd cache hit skips, under the cache's key."""

    def cache_saved(self, key: str, graphs: GraphKeys) -> None:
        """AOTAutograd saved the pair compiled as `graphs` under `key`. Never raises."""

    def cache_hit(self, key: str, graphs: GraphKeys) -> Callable[[], None] | None:
        """AOTAutograd found `key`: the call that records the hit from the keeper's own record, or
        None when it has none (the hit is then turned into a miss). Never raises."""

    def graph_hit(self, key: str) -> bool:
        """Inductor's FX graph cache found `key`: whether the keeper has its record (if not, the hit
        is turned into a miss). Never raises."""


class PartitionObserver(Protocol):
    def partition_started(self, joint: Any) -> Any:
        """Called before a partition; the value returned goes to `partition_done`. Never raises."""

    def partition_done(self, token: Any, fn: Partitioner, backend: str, kwargs: dict[str, Any],
                       result: tuple[Any, Any] | None) -> None:
        """Called after it (`result` None: the partitioner raised). Never raises."""


_lock = threading.RLock()
_observers: list[PartitionObserver] = []
_uncached: list[PartitionObserver] = []  # observers that need both compile caches off
_keepers: list[RecordKeeper] = []
_transforms: list[tuple[str, Transform]] = []  # (cache salt, transform), innermost last
_patches: Patches | None = None
_cache_defaults: dict[str, bool] = {}


@functools.cache
def source_hash(salt: str) -> str:
    """sha256 of `salt` and memprof's Python source (a memprof pass decides from nothing else)."""
    h = hashlib.sha256(salt.encode())
    package = Path(__file__).resolve().parent.parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _stock() -> Partitioner:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition  # type: ignore[no-any-return]


def run(inner: Partitioner | None, gm: Any, joint_inputs: Any, backend: str, kwargs: dict[str, Any]) -> Any:
    """Partition `gm` with `inner` (default: min-cut) through the chain."""
    fn = inner if inner is not None else _stock()
    with _lock:
        observers = list(_observers)
        transform = _transforms[-1][1] if _transforms and not isinstance(fn, Transforming) else None
    tokens = [(o, o.partition_started(gm)) for o in observers]
    result: tuple[Any, Any] | None = None
    try:
        result = transform(fn, gm, joint_inputs, kwargs) if transform else fn(gm, joint_inputs, **kwargs)
    finally:
        for o, token in tokens:
            o.partition_done(token, fn, backend, kwargs, result)
    return result


@functools.cache
def _inductor_class() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class ChainPartitioner(CustomPartitionerFn):  # type: ignore[misc]
        """Inductor's `custom_partitioner_fn` while the chain is installed."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __call__(self, gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
            return run(self.inner, gm, joint_inputs, "inductor", kwargs)

        def __reduce__(self) -> tuple[Any, ...]:  # Inductor pickles its config for cache keys
            return _make_chain, (self.inner,)

        def uuid(self) -> str | None:
            with _lock:
                if _uncached:
                    return None  # a recorded compile: no cache may skip it
                salt = _transforms[-1][0] if _transforms and not isinstance(self.inner, Transforming) else ""
                if _observers:
                    salt = f"observed|{salt}"  # memprof's own entries: each hit has memprof's record
            inner_id = None
            if self.inner is not None:
                inner_id = self.inner.uuid() if hasattr(self.inner, "uuid") else None
                if inner_id is None:
                    return None  # an uncacheable partitioner inside: no key at all
            return source_hash(f"{salt}|{inner_id}")

    return ChainPartitioner


def _make_chain(inner: Any) -> Any:
    return _inductor_class()(inner)


class _ChainPartitionFn:
    """A non-Inductor backend's `partition_fn` through the chain."""

    def __init__(self, inner: Partitioner, backend: str) -> None:
        self.inner = inner
        self.backend = backend
        self.__name__ = getattr(inner, "__name__", type(inner).__name__)

    def __call__(self, joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        return run(self.inner, joint, joint_inputs, self.backend, kwargs)


def _aot_call(original: Callable[..., Any]) -> Callable[..., Any]:
    from torch._dynamo.backends.common import AotAutograd
    from torch._functorch.partitioners import default_partition

    def call(backend: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        fn = backend.kwargs.get("partition_fn", default_partition)
        module = getattr(getattr(fn, "func", fn), "__module__", "") or ""
        with _lock:
            idle = not _observers and not _transforms
        if idle or module.startswith("torch._inductor") or isinstance(fn, _ChainPartitionFn):
            return original(backend, gm, example_inputs, **kwargs)  # Inductor's own: custom_partitioner_fn
        name = getattr(backend.kwargs.get("fw_compiler"), "__name__", "aot")
        label = "aot_eager" if name in ("boxed_nop", "nop") else f"aot_autograd({name})"
        clone = AotAutograd(**{**backend.kwargs, "partition_fn": _ChainPartitionFn(fn, label)})
        return original(clone, gm, example_inputs, **kwargs)

    return call


def _entry_graphs(entry: Any) -> GraphKeys:
    """The FX graph cache keys of an AOTAutograd cache entry's forward and backward (the field
    moved between torch versions; a bundled entry carries the compiled graph itself)."""
    def key(part: Any) -> str | None:
        info = getattr(part, "fx_graph_cache_info", None)
        if isinstance(info, tuple) and info and isinstance(info[0], str):
            return info[0]
        found = getattr(part, "fx_graph_cache_key", None) or getattr(getattr(part, "result", None),
                                                                     "_fx_graph_cache_key", None)
        return found if isinstance(found, str) else None

    return key(getattr(entry, "compiled_fw", None)), key(getattr(entry, "compiled_bw", None))


def _current_keepers() -> list[RecordKeeper]:
    with _lock:
        return list(_keepers)


_pending = threading.local()  # the keepers' records of the hit `try_load` is loading on this thread


def _aot_lookup(original: Callable[..., Any]) -> Callable[..., Any]:
    def lookup(key: str, *args: Any, **kwargs: Any) -> Any:
        result = original(key, *args, **kwargs)
        if result is None:
            return None
        graphs = _entry_graphs(result[0] if isinstance(result, tuple) else result)
        replays = [k.cache_hit(key, graphs) for k in _current_keepers()]
        if any(r is None for r in replays):
            return None  # a hit memprof has no record of: compiled again, and recorded
        _pending.replays = replays
        return result

    return lookup


def _aot_try_load(original: Callable[..., Any]) -> Callable[..., Any]:
    """Record a hit only once it loaded: its FX graphs can still miss, and then it compiles."""
    def try_load(*args: Any, **kwargs: Any) -> Any:
        outer, _pending.replays = getattr(_pending, "replays", None), None
        try:
            result = original(*args, **kwargs)
        finally:
            replays, _pending.replays = _pending.replays, outer
        if (result[0] if isinstance(result, tuple) else result) is not None:
            for replay in replays or ():
                replay()
        return result

    return try_load


def _aot_save(original: Callable[..., Any]) -> Callable[..., Any]:
    def save(key: str, entry: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(key, entry, *args, **kwargs)
        graphs = _entry_graphs(entry)
        for k in _current_keepers():
            k.cache_saved(key, graphs)
        return result

    return save


def _fx_lookup(original: Callable[..., Any]) -> Callable[..., Any]:
    def lookup(key: str, *args: Any, **kwargs: Any) -> Any:
        graph, info = original(key, *args, **kwargs)
        if graph is not None and not all(k.graph_hit(key) for k in _current_keepers()):
            return None, info  # a graph memprof has no record of: compiled again, and recorded
        return graph, info

    return lookup


_AOT_CACHE = "torch._functorch._aot_autograd.autograd_cache"
_caches_hooked = False  # the caches' lookups and saves reach the keepers

_CACHE_FLAGS = (("torch._inductor.config", "fx_graph_cache"),
                ("torch._functorch.config", "enable_autograd_cache"))


def _hook_caches(patches: Patches) -> bool:
    """Route AOTAutograd's cache lookups and saves, and the FX graph cache's lookups, through the
    keepers; False where this torch's caches are not the ones memprof knows (AOTAutograd's then
    stays off while anything observes)."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
        from torch._inductor.codecache import FxGraphCache

        lookup, save, load = AOTAutogradCache._lookup, AOTAutogradCache.save, AOTAutogradCache.try_load
        fx_lookup = FxGraphCache._lookup_graph
    except (ImportError, AttributeError):
        return False
    patches.set("torch._inductor.codecache", "FxGraphCache._lookup_graph", staticmethod(_fx_lookup(fx_lookup)))
    patches.set(_AOT_CACHE, "AOTAutogradCache._lookup", staticmethod(_aot_lookup(lookup)))
    patches.set(_AOT_CACHE, "AOTAutogradCache.try_load", staticmethod(_aot_try_load(load)))
    patches.set(_AOT_CACHE, "AOTAutogradCache.save", staticmethod(_aot_save(save)))
    return True


def _refresh() -> None:
    """Install the chain for the first user, remove it after the last; set the cache flags."""
    global _patches, _caches_hooked
    if (_observers or _transforms) and _patches is None:
        import torch._inductor.config as inductor_config
        from torch._dynamo.backends.common import AotAutograd

        patches = Patches()
        try:
            patches.set("torch._inductor.config", "custom_partitioner_fn",
                        _inductor_class()(inductor_config.custom_partitioner_fn))
            patches.set("torch._dynamo.backends.common", "AotAutograd.__call__", _aot_call(AotAutograd.__call__))
            install_reuse_rule(patches)  # (a no-op for graphs the remat pass did not plan)
            _caches_hooked = _hook_caches(patches)
            for module, name in _CACHE_FLAGS:
                obj, attr = resolve(module, name)
                _cache_defaults[name] = bool(getattr(obj, attr))
                patches.set(module, name, getattr(obj, attr))
        except BaseException:
            patches.undo()
            raise
        _patches = patches
    elif not (_observers or _transforms) and _patches is not None:
        patches, _patches = _patches, None
        patches.undo()
        return
    if _patches is not None:
        wanted = {"fx_graph_cache": _cache_defaults["fx_graph_cache"] and not _uncached,
                  "enable_autograd_cache": _cache_defaults["enable_autograd_cache"] and not _uncached
                  and not _transforms and (_caches_hooked or not _observers)}
        for module, name in _CACHE_FLAGS:
            obj, attr = resolve(module, name)
            setattr(obj, attr, wanted[name])


@contextlib.contextmanager
def _joined(items: list[Any], item: Any) -> Iterator[None]:
    with _lock:
        items.append(item)
        try:
            _refresh()
        except BaseException:
            items.remove(item)
            raise
    try:
        yield
    finally:
        with _lock:
            items.remove(item)
            _refresh()


@contextlib.contextmanager
def observing(observer: PartitionObserver, keeper: RecordKeeper | None = None) -> Iterator[None]:
    """Within: `observer` sees every partition. With a `keeper` (which keeps what a cache hit
    skips) AOTAutograd's and Inductor's FX graph caches stay on; without one both are off."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_joined(_uncached if keeper is None else _keepers, observer if keeper is None else keeper))
        stack.enter_context(_joined(_observers, observer))
        yield


def transforming(salt: str, transform: Transform) -> contextlib.AbstractContextManager[None]:
    """Within: every partition runs through `transform` (the innermost one, when blocks nest);
    `salt` names it in Inductor's cache key."""
    return _joined(_transforms, (salt, transform))
