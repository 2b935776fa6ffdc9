"""One patch/undo helper for every replacement memprof makes in torch (and in networkx and
multiprocessing, which torch's code paths call).

Every attribute memprof ever replaces is declared in `TARGETS`, so the set is visible in one
place and a test can check that each one is restored after a capture, a remat block or a
prediction run (`tests/integration/test_torch_hooks.py`).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

# (module, attribute path): everything `Patches.set` may replace
TARGETS: tuple[tuple[str, str], ...] = (
    ("torch._inductor.config", "custom_partitioner_fn"),
    ("torch._inductor.config", "fx_graph_cache"),
    ("torch._functorch.config", "enable_autograd_cache"),
    ("torch._dynamo.backends.common", "AotAutograd.__call__"),
    ("torch._functorch._aot_autograd.autograd_cache", "AOTAutogradCache._lookup"),
    ("torch._functorch._aot_autograd.autograd_cache", "AOTAutogradCache.save"),
    ("torch._functorch._aot_autograd.autograd_cache", "AOTAutogradCache.try_load"),
    ("torch._inductor.codecache", "FxGraphCache._lookup_graph"),
    ("torch._inductor.graph", "GraphLowering.codegen"),
    ("torch._inductor.memory", "estimate_peak_memory"),
    ("torch._inductor.compile_fx", "_compile_fx_inner"),
    ("torch._inductor.codegen.wrapper", "AllocateLine.should_reuse_buffer"),
    ("torch._inductor.compile_fx", "_recursive_joint_graph_passes"),
    ("torch._inductor.output_code", "CompiledFxGraph.__call__"),
    ("torch._inductor.async_compile", "AsyncCompile.triton"),
    ("torch._inductor.async_compile", "AsyncCompile.cpp"),
    ("torch._inductor.async_compile", "AsyncCompile.cpp_pybinding"),
    ("torch._inductor.runtime.triton_heuristics", "check_autotune_cache"),
    ("torch._functorch._aot_autograd.graph_compile", "aot_stage2_autograd"),
    ("torch._functorch.partitioners", "_optimize_runtime_with_given_memory"),
    ("torch._functorch.partitioners", "choose_saved_values_set"),
    ("torch._functorch.partitioners", "solve_min_cut"),
    ("torch._functorch.partitioners", "estimate_runtime"),
    ("torch.autograd.profiler", "_run_on_profiler_start"),
    ("torch.autograd.profiler", "_is_profiler_enabled"),
    ("torch", "compile"),
    ("torch", "Tensor.backward"),
    ("torch.autograd", "backward"),
    ("networkx", "minimum_cut"),
    ("multiprocessing.process", "BaseProcess.start"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel._ddp_init_helper"),
    ("torch._C._distributed_c10d", "Reducer._rebuild_buckets"),
)
_DECLARED = frozenset(TARGETS)
# (module, class, attribute): an attribute of instances made at run time, replaced on the instances a
# feature picks (`Patches.set_on`)
INSTANCE_TARGETS: tuple[tuple[str, str, str], ...] = (
    ("torch._ops", "OpOverload", "_op"),  # what `OpOverload.__call__` calls
)


def resolve(module: str, path: str) -> tuple[Any, str]:
    """The object that holds a declared target's attribute, and the attribute's name."""
    obj: Any = importlib.import_module(module)
    *owners, name = path.split(".")
    for owner in owners:
        obj = getattr(obj, owner)
    return obj, name


def current(module: str, path: str) -> Any:
    """A target's value now (as stored: a class's own attribute, not a bound method)."""
    obj, name = resolve(module, path)
    return obj.__dict__.get(name) if isinstance(obj, type) else getattr(obj, name, None)


class Patches:
    """Replacements made by one memprof feature, undone together in reverse order.

    `set` replaces a declared attribute and remembers the old value; `on_undo` adds any other
    cleanup (a removed hook handle, a log handler). `undo` runs every cleanup even if one fails,
    then raises the first failure. A context manager: undone on exit."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, module: str, path: str, value: Any) -> Any:
        """Replace `module`'s attribute `path` (declared in `TARGETS`); returns the old value."""
        if (module, path) not in _DECLARED:
            raise AssertionError(f"{module}.{path} is not a declared patch target (memprof.torch_hooks.patch.TARGETS)")
        obj, name = resolve(module, path)
        own = isinstance(obj, type) and name in obj.__dict__
        old = obj.__dict__[name] if own else getattr(obj, name)
        setattr(obj, name, value)
        if isinstance(obj, type) and not own:  # an inherited attribute: remove the class's own one
            self._undo.append(lambda: delattr(obj, name))
        else:
            self._undo.append(lambda: setattr(obj, name, old))
        return old

    def set_on(self, obj: Any, name: str, value: Any) -> Any:
        """Replace the instance attribute `name` of `obj` (declared in `INSTANCE_TARGETS`); returns the
        old value."""
        if not any(name == attr and isinstance(obj, getattr(importlib.import_module(module), cls))
                   for module, cls, attr in INSTANCE_TARGETS):
            raise AssertionError(f"{type(obj).__name__}.{name} is not a declared instance patch target "
                                 "(memprof.torch_hooks.patch.INSTANCE_TARGETS)")
        old = obj.__dict__[name]
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old))
        return old

    def on_undo(self, fn: Callable[[], Any]) -> None:
        self._undo.append(fn)

    def undo(self) -> None:
        first: BaseException | None = None
        while self._undo:
            fn = self._undo.pop()
            try:
                fn()
            except BaseException as exc:  # every cleanup runs; the first failure is raised after
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def __len__(self) -> int:
        return len(self._undo)


@contextlib.contextmanager
def patched(module: str, path: str, value: Any) -> Any:
    """One declared replacement for the duration of a block."""
    with Patches() as p:
        p.set(module, path, value)
        yield
