"""What a capture hooks at run time, outside torch.compile: Inductor's per-kernel scopes (the
profiler flag), torch.profiler starting, optimizer steps, Python's garbage collector, processes
started with multiprocessing and Dynamo's recompile-limit message. Each hook is undone with the
`Patches` it was installed with."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from memprof.torch_hooks.patch import Patches


def kernel_scopes(patches: Patches) -> None:
    """Make Inductor open a RecordFunction scope for each compiled-graph call and kernel launch
    (it does so only while the autograd profiler flag is set)."""
    patches.set("torch.autograd.profiler", "_is_profiler_enabled", True)


def graph_call_scopes(patches: Patches, op_scope: bool | None, quiet: QuietScopes | None = None,
                      watch: TangentWatch | None = None) -> None:
    """Open a scope named as Inductor's own (`## Call CompiledFxGraph <key> ##`) around each
    compiled-graph call, without the profiler flag, which would also make Inductor open one per
    kernel launch. `op_scope`: as Inductor opens it (RecordScope::FUNCTION, straight from C++), for
    captures that record op scopes; False: a user scope (`--scopes graphs`, which leaves op scopes
    off: every aten op would run memprof's callback); None: no scope (`--scopes none`, or Inductor
    opens its own), the call only watched. A user scope's end is an op that a dispatch mode sees:
    AOTAutograd's first call of a graph runs under one, and with op scopes recorded that call's end
    went missing. Needs Inductor loaded (`on_first_compile`).

    `quiet` (op scopes only): from a graph's second call on, its body runs with memprof's op scopes
    off, every aten op on the dispatcher's fast path, and only the calls that allocate recorded as
    scopes (`_QuietGraphs`). `watch`: sees each graph's first call (`TangentWatch`)."""
    import torch
    from torch._inductor.output_code import CompiledFxGraph

    original = CompiledFxGraph.__dict__["__call__"]
    scope: Any = (contextlib.nullcontext if op_scope is None else
                  torch._C._profiler._RecordFunctionFast if op_scope else torch.autograd.profiler.record_function)
    graphs = _QuietGraphs(patches, quiet) if op_scope and quiet is not None else None

    @functools.wraps(original)
    def call(self: Any, inputs: Any) -> Any:
        key = self._fx_graph_cache_key
        after = watch.first_call(key, inputs) if watch is not None and key not in watch.called else None
        with scope(f"## Call CompiledFxGraph {key} ##"):
            if graphs is None or not graphs.ready(key, self):
                out = original(self, inputs)
            else:
                was = graphs.quiet.set_quiet(True)
                try:
                    out = original(self, inputs)
                finally:
                    graphs.quiet.set_quiet(was)
        if after is not None:
            after()
        return out

    patches.set("torch._inductor.output_code", "CompiledFxGraph.__call__", call)


class TangentWatch:
    """Which of a compiled backward's tangents outlive its first call: AOTAutograd hands the graph
    its arguments as a list the wrapper clears, so a tangent whose storage is still alive when the
    call returns is held elsewhere (the autograd engine, on torch 2.11; a gradient the script keeps)
    and stays live through the backward; the others were freed at the wrapper's `del`. The compile-
    time estimate holds tangents as this says (`memprof.sweep.step_estimate.kept_tangents`).

    `tangents(key)`: for a graph's cache key, its plan's index and the (input position, name) of
    each tangent, None for a graph that is not a backward; `seen(plan, names)` gets the names that
    outlived the call. Storages are held by weak references only: a reference held here would keep
    a tangent live."""

    def __init__(self, tangents: Callable[[str], tuple[int, list[tuple[int, str]]] | None],
                 seen: Callable[[int, list[str]], None]) -> None:
        self.tangents, self.seen = tangents, seen
        self.called: set[Any] = set()

    def first_call(self, key: Any, inputs: Any) -> Callable[[], None] | None:
        self.called.add(key)
        try:
            found = self.tangents(key) if key else None
            if found is None or not isinstance(inputs, list):
                return None
            plan, where = found
            refs = _storage_refs([(inputs[i] if i < len(inputs) else None, name) for i, name in where])
        except Exception:  # never fail the user's step over an observation
            return None
        if refs is None:
            return None
        return lambda: self.seen(plan, [name for name, ref in refs if not ref.expired()])


def _storage_refs(tensors: list[tuple[Any, str]]) -> list[tuple[str, Any]] | None:
    """A weak reference to each tensor's storage, by name; None where one is not a plain tensor (a
    subclass's storage is not where its memory is)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    if any(type(t) is not torch.Tensor for t, _name in tensors):
        return None
    return [(name, StorageWeakRef(t.untyped_storage())) for t, name in tensors]  # type: ignore[no-untyped-call]


class QuietScopes(Protocol):
    """The native switches of quiet compiled-graph calls (`memprof._native`)."""

    def set_quiet(self, quiet: bool) -> bool: ...

    def quiet_scope(self, name: str, begin: bool) -> bool: ...


class _QuietGraphs:
    """Which compiled graphs run quiet. Op scopes inside a compiled-graph call cost as much as the
    rest of a host-bound step's scopes together, and the join needs only those of the calls that
    return fresh tensors (`wrapper_code.scoped_calls`): memprof wraps each of those operator
    overloads to record its scope itself, the ops it runs left quiet. A graph's first call stays
    loud (cuBLAS takes its workspace inside the first matmul, and autotuning runs there), as does a
    graph whose wrapper may allocate where no scope would show it, or one with no cache key to tell
    it from others."""

    def __init__(self, patches: Patches, quiet: QuietScopes) -> None:
        self.patches, self.quiet = patches, quiet
        self.graphs: dict[str, bool | None] = {}  # key -> quiet from now on (None: called once)
        self.wrapped: set[int] = set()  # ids of the overloads wrapped

    def ready(self, key: Any, graph: Any) -> bool:
        if not key:
            return False
        if key not in self.graphs:
            self.graphs[key] = None
            return False
        state = self.graphs[key]
        if state is not None:
            return state
        try:
            state = self._wrap(graph.source_code)
        except Exception:  # never fail the user's step over a scope
            state = False
        self.graphs[key] = state
        return state

    def _wrap(self, source: Any) -> bool:
        import torch

        from memprof.analysis.wrapper_code import scoped_calls

        ops = scoped_calls(source) if isinstance(source, str) else None
        if ops is None:
            return False
        overloads = []
        for path in ops:
            namespace, op, name = path.split(".")
            overloads.append(getattr(getattr(getattr(torch.ops, namespace), op), name))
        for overload in overloads:
            if id(overload) not in self.wrapped:
                self.patches.set_on(overload, "_op", self._scoped(overload._op, overload._schema.name))
                self.wrapped.add(id(overload))
        return True

    def _scoped(self, inner: Callable[..., Any], name: str) -> Callable[..., Any]:
        """`inner` (an overload's builtin), recorded as a scope named as RecordFunction names the op's
        when it runs in a quiet call; as it is elsewhere (RecordFunction records it there)."""
        scope = self.quiet.quiet_scope

        def op(*args: Any, **kwargs: Any) -> Any:
            if not scope(name, True):
                return inner(*args, **kwargs)
            try:
                return inner(*args, **kwargs)
            finally:
                scope(name, False)

        return op


def on_first_compile(patches: Patches, install: Callable[[], None]) -> None:
    """Run `install` (the compile hooks) before anything compiles, without importing Dynamo and
    Inductor first (about two seconds of a script's start): now if Dynamo is already loaded (a
    model compiled before the capture may compile its graphs inside it), else at the first
    `torch.compile` call. `install` runs once; what it patches must go into `patches`."""
    import sys

    import torch

    if "torch._dynamo" in sys.modules:
        install()
        return
    original = torch.compile
    done: list[bool] = []

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            install()
        return original(*args, **kwargs)

    patches.set("torch", "compile", compile)


def dynamo_frames_compiled() -> int:
    """Frames Dynamo has compiled in this process (0 when Dynamo is not loaded)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    try:
        return int(utils.counters["frames"]["ok"]) if utils is not None else 0
    except Exception:
        return 0


def on_profiler_start(patches: Patches, before: Callable[[], None]) -> None:
    """Call `before` when torch.profiler starts (before it takes PyTorch's profiler slot)."""
    import torch.autograd.profiler as autograd_profiler

    original = autograd_profiler._run_on_profiler_start

    def run_on_profiler_start() -> None:
        before()
        original()  # type: ignore[no-untyped-call]

    patches.set("torch.autograd.profiler", "_run_on_profiler_start", run_on_profiler_start)


def on_optimizer_step(patches: Patches, fn: Callable[[Any], None]) -> None:
    """Call `fn(optimizer)` after every optimizer step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        fn(optimizer)

    handle = register_optimizer_step_post_hook(hook)  # type: ignore[no-untyped-call]
    patches.on_undo(handle.remove)


def on_gc(patches: Patches, fn: Callable[[bool], None]) -> None:
    """Call `fn(True)` at the start and `fn(False)` at the end of every garbage collection."""
    def callback(phase: str, info: dict[str, Any]) -> None:
        fn(phase == "start")

    gc.callbacks.append(callback)
    patches.on_undo(lambda: gc.callbacks.remove(callback))


def on_ddp_buckets(patches: Patches, fn: Callable[[bool], None]) -> None:
    """Call `fn(True)` before and `fn(False)` after the DDP code that allocates the reducer's
    gradient buckets: its construction (`DistributedDataParallel._ddp_init_helper`) and its rebuild
    in the second iteration's forward (`Reducer._rebuild_buckets`). Only where torch.distributed is
    built and DDP already imported (torch imports it with torch.nn)."""
    import sys

    ddp = sys.modules.get("torch.nn.parallel.distributed")
    c10d = sys.modules.get("torch._C._distributed_c10d")
    owners = [("torch.nn.parallel.distributed", "DistributedDataParallel._ddp_init_helper", ddp),
              ("torch._C._distributed_c10d", "Reducer._rebuild_buckets", c10d)]
    for module, path, mod in owners:
        cls_name, name = path.split(".")
        original = getattr(getattr(mod, cls_name, None), name, None)
        if original is None:
            continue

        def marked(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            fn(True)
            try:
                return __original(self, *args, **kwargs)
            finally:
                fn(False)

        patches.set(module, path, marked)


_fork_watchers: list[Callable[[], None]] = []  # what os.fork calls in the parent (registered once a process)
_in_process_start = threading.local()


def _after_fork_in_parent() -> None:
    if not getattr(_in_process_start, "on", False):  # (multiprocessing's fork is counted as its process)
        for watch in list(_fork_watchers):
            watch()


def on_process_start(patches: Patches, fn: Callable[[bool], None]) -> None:
    """Call `fn(is_dataloader_worker)` for every process started with multiprocessing, and `fn(False)`
    for every bare `os.fork()` (a child that runs on in the script's code)."""
    import multiprocessing.process as mp_process

    original_start = mp_process.BaseProcess.start

    def start(proc: Any) -> None:
        target = getattr(getattr(proc, "_target", None), "__module__", "") or ""
        fn(target.startswith("torch.utils.data"))
        _in_process_start.on = True
        try:
            original_start(proc)
        finally:
            _in_process_start.on = False

    patches.set("multiprocessing.process", "BaseProcess.start", start)
    if not hasattr(os, "register_at_fork"):
        return
    if not _fork_hook:  # os.register_at_fork cannot be undone: one hook, watchers added and removed
        os.register_at_fork(after_in_parent=_after_fork_in_parent)
        _fork_hook.append(True)

    def forked() -> None:
        fn(False)

    _fork_watchers.append(forked)
    patches.on_undo(lambda: _fork_watchers.remove(forked))


_fork_hook: list[bool] = []


def on_recompile_limit(patches: Patches, fn: Callable[[str], None]) -> None:
    """Call `fn(what)` when Dynamo gives up on a frame at its recompile limit (a log handler: reads only)."""

    class RecompileLimit(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
                with contextlib.suppress(Exception):
                    first = record.getMessage().splitlines()
                    where = next((ln.strip() for ln in first if ln.strip().startswith("function:")), "")
                    fn(f"{first[0].removeprefix('torch._dynamo hit ')}{', ' + where if where else ''}")

    handler = RecompileLimit(logging.WARNING)
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    dynamo_log.addHandler(handler)
    patches.on_undo(lambda: dynamo_log.removeHandler(handler))


def cuda_live_blocks() -> dict[str, list[list[int]]]:
    """(ptr, bytes) of every CUDA caching-allocator block in use (no allocation history needed)."""
    import torch

    out: dict[str, list[list[int]]] = {}
    try:
        for seg in torch.cuda.memory_snapshot():  # type: ignore[no-untyped-call]
            dev = f"cuda:{int(seg.get('device', 0))}"
            for block in seg.get("blocks", []):
                if block.get("state") == "active_allocated":
                    out.setdefault(dev, []).append([int(block["address"]), int(block["size"])])
    except Exception:  # an allocator backend without snapshots: bytes stay "before the capture"
        return {}
    return out
