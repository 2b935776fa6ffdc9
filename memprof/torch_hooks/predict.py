"""What a budget prediction (`memprof sweep --predict`) changes in torch while the script runs:
kernels compiled only when first called, compiled graphs run op by op, several budgets sharing one
AOTAutograd stage (and one run of the joint-graph passes), and the first backward call stopping
the script. Each is undone with the `Patches` it was installed with."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from memprof.errors import one_line
from memprof.torch_hooks.patch import Patches


class Book(Protocol):
    """The prediction's bookkeeping that `share_joint_graph` reports into."""

    errors: dict[float, str]
    shared_seconds: float

    def compiling(self, budget: float) -> contextlib.AbstractContextManager[None]: ...


class LazyKernel:
    """A kernel Inductor asked for, compiled at its first call (or attribute read) instead: in a
    prediction most are never called (the backward's, every kernel of the budgets compiled beside
    the one the script runs with)."""

    def __init__(self, compile_kernel: Callable[[], Any], name: str) -> None:
        self._compile = compile_kernel
        self._kernel: Any = None
        self.name = name

    @property
    def is_compiled(self) -> bool:
        return self._kernel is not None

    def kernel(self) -> Any:
        if self._kernel is None:
            k = self._compile()
            self._kernel = k.result() if callable(getattr(k, "result", None)) else k  # a pool's future
        return self._kernel

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel()(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel().run(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.kernel(), name)


def lazy_kernels(patches: Patches, made: list[LazyKernel]) -> None:
    """Inductor's kernel compilers (`AsyncCompile.triton`, `.cpp`, `.cpp_pybinding`) return a
    `LazyKernel`, compiled when first called; each is appended to `made`."""
    import functools

    from torch._inductor.async_compile import AsyncCompile

    def deferred(kind: str, compile_now: Callable[..., Any]) -> Callable[..., LazyKernel]:
        def compile_later(self: Any, *args: Any, **kwargs: Any) -> LazyKernel:
            name = args[0] if kind == "triton" and args and isinstance(args[0], str) else kind
            made.append(LazyKernel(functools.partial(compile_now, self, *args, **kwargs), str(name)))
            return made[-1]

        return compile_later

    for k in ("triton", "cpp", "cpp_pybinding"):
        if k in AsyncCompile.__dict__:
            patches.set("torch._inductor.async_compile", f"AsyncCompile.{k}", deferred(k, AsyncCompile.__dict__[k]))


def graph_copy(gm: Any) -> Any:
    """A GraphModule copied as AOTAutograd copies its backward: nodes copied, their metadata shared."""
    import copy

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return copy.deepcopy(gm)


class EagerRun:
    """Runs a compiled graph as its FX graph, op by op (Inductor's boxed calling convention: one
    list of inputs, cleared once they are consumed); falls back to the compiled code if that fails."""

    def __init__(self, graph: Any, compiled: Callable[[list[Any]], Any], note: Callable[[str], None],
                 before_run: Callable[[], None] | None = None) -> None:
        self.graph: Any = graph
        self.compiled = compiled
        self.note = note
        self.before_run = before_run
        self.eager_calls = 0

    def __call__(self, inputs: list[Any]) -> Any:
        if self.before_run is not None:
            self.before_run()
        if self.graph is not None:
            try:
                out = self.graph(*inputs)
            except Exception as exc:
                self.note(f"a compiled graph ran its compiled code: its op-by-op run failed ({one_line(exc)})")
                self.graph = None
            else:
                self.eager_calls += 1
                inputs.clear()
                return out
        return self.compiled(inputs)


def eager_runs(patches: Patches, made: list[EagerRun], note: Callable[[str], None],
               before_run: Callable[[], None] | None = None) -> None:
    """Each graph Inductor compiles (`_compile_fx_inner`, every pass and the code generation
    as usual) is run op by op by an `EagerRun` of its graph as given (copied before Inductor's passes
    change it in place), appended to `made`. A graph that cannot be copied runs its compiled code.
    `before_run` is called before each run of a compiled graph."""
    import torch._inductor.compile_fx as compile_fx

    inner = compile_fx._compile_fx_inner

    def compile_run_eager(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            eager = graph_copy(gm)
        except Exception as exc:
            note(f"a compiled graph runs its compiled code: not copied ({one_line(exc)})")
            eager = None
        compiled: Any = inner(gm, example_inputs, *args, **kwargs)
        if eager is not None and callable(getattr(compiled, "current_callable", None)):
            made.append(EagerRun(eager, compiled.current_callable, note, before_run))
            compiled.current_callable = made[-1]
        return compiled

    compile_run_eager.__wrapped__ = inner  # type: ignore[attr-defined]
    patches.set("torch._inductor.compile_fx", "_compile_fx_inner", compile_run_eager)


def copies(aot_state: Any, capture: Any) -> tuple[Any, Any]:
    """An AOTState and AOTGraphCapture for one more partition of the same joint graph: the graph
    copied as AOTAutograd copies its backward (node metadata shared, not copied), the metadata's
    containers copied (partitioning writes into them), the inputs' lists copied."""
    import copy
    import dataclasses

    gm = graph_copy(capture.graph_module)
    args = capture.updated_flat_args
    args = tuple(list(a) for a in args) if isinstance(args, tuple) else list(args)
    meta = copy.copy(aot_state.fw_metadata)
    for k, v in vars(meta).items():
        if isinstance(v, dict | list | set):
            object.__setattr__(meta, k, copy.copy(v))
    return dataclasses.replace(aot_state, fw_metadata=meta), dataclasses.replace(capture, graph_module=gm,
                                                                                 updated_flat_args=args)


def sharing_available() -> bool:
    """Whether this torch has the stage that several budgets can share a process through."""
    try:
        import torch._functorch._aot_autograd.graph_compile as graph_compile
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:
        return False
    return callable(getattr(graph_compile, "aot_stage2_autograd", None)) and hasattr(AsyncCompile, "triton")


def share_joint_graph(patches: Patches, book: Book, first: float, others: Sequence[float]) -> None:
    """AOTAutograd's partition-and-compile stage compiles `others` before `first`, each from a copy
    of the same joint graph."""
    import torch._functorch._aot_autograd.graph_compile as graph_compile

    from memprof.torch_hooks.budget import budget_set

    original = graph_compile.aot_stage2_autograd
    inside = threading.local()

    # torch 2.11: (aot_state, aot_graph_capture); 2.13 adds partition_fn, fw_compiler, bw_compiler
    def stage2(aot_state: Any, capture: Any, *rest: Any, **kwargs: Any) -> Any:
        if getattr(inside, "region", False):
            # AOTAutograd called from within a region's compile (Inductor's pattern matcher traces a
            # replacement's joint graph with aot_function, recording it in its own partition_fn):
            # that graph is the matcher's, once, under the budget being compiled
            return original(aot_state, capture, *rest, **kwargs)
        inside.region = True
        try:
            return _each_budget(aot_state, capture, *rest, **kwargs)
        finally:
            inside.region = False

    def _each_budget(aot_state: Any, capture: Any, *rest: Any, **kwargs: Any) -> Any:
        with _joint_passes_once(book, reuse=bool(others)) as next_budget:
            for b in others:
                if b in book.errors:
                    continue  # failed in an earlier region: its prediction is lost anyway
                next_budget()
                with book.compiling(b):
                    try:
                        state, cap = copies(aot_state, capture)
                        with budget_set(b):
                            original(state, cap, *rest, **kwargs)
                    except Exception as exc:
                        book.errors[b] = one_line(exc)
                        if os.environ.get("MEMPROF_DEBUG"):  # (as the CLI's own internal errors)
                            traceback.print_exc()
            next_budget()
            with book.compiling(first):
                return original(aot_state, capture, *rest, **kwargs)

    patches.set("torch._functorch._aot_autograd.graph_compile", "aot_stage2_autograd", stage2)


@contextlib.contextmanager
def _joint_passes_once(book: Book, reuse: bool) -> Iterator[Callable[[], None]]:
    """Within (one compiled region, its budgets in turn): Inductor's joint-graph passes run for the
    first budget only; every later one gets a copy of what they made, call by call (the same joint
    graph, and passes that do not depend on the budget; with `reuse` False, one budget alone, nothing
    is kept). Yields `next_budget`, called before each budget. The passes' seconds go to
    `book.shared_seconds`, not to the budget that ran them."""
    import torch._inductor.compile_fx as compile_fx

    passes = compile_fx._recursive_joint_graph_passes
    made: list[Any] = []  # the first budget's outputs, in call order (copies: its partitioner changes them)
    state = {"call": 0, "depth": 0}

    def next_budget() -> None:
        state["call"] = 0

    def joint_passes_once(gm: Any, *args: Any, **kwargs: Any) -> Any:
        if state["depth"]:  # a subgraph, inside the passes of its graph
            return passes(gm, *args, **kwargs)
        i = state["call"]
        state["call"] += 1
        t0 = time.perf_counter()
        try:
            if i < len(made):
                return graph_copy(made[i])
            state["depth"] += 1
            try:
                out = passes(gm, *args, **kwargs)
            finally:
                state["depth"] -= 1
            if reuse and i == len(made):
                made.append(graph_copy(out))
            return out
        finally:
            book.shared_seconds += time.perf_counter() - t0

    joint_passes_once.__wrapped__ = passes  # type: ignore[attr-defined]
    with Patches() as patches:
        patches.set("torch._inductor.compile_fx", "_recursive_joint_graph_passes", joint_passes_once)
        yield next_budget




def stop_at_backward(patches: Patches, stop: type[BaseException],
                     before: Callable[[list[Any]], None] | None = None) -> None:
    """`Tensor.backward` and `torch.autograd.backward` raise `stop`: the first backward call ends
    the script (not `torch.autograd.grad`: AOTAutograd traces the joint graph with it). `before` is
    called first, with the tensors the backward starts from, while the script's objects are alive."""
    def raise_stop(*a: Any, **k: Any) -> Any:
        if before is not None:
            roots = a[0] if a else k.get("tensors")
            before(list(roots) if isinstance(roots, (list, tuple)) else [roots])
        raise stop()

    patches.set("torch", "Tensor.backward", raise_stop)
    patches.set("torch.autograd", "backward", raise_stop)


def allocator_segments() -> tuple[int, list[dict[str, Any]]] | None:
    """The current CUDA device and its caching allocator's segments as a memory snapshot shows them
    (`torch.cuda.memory._snapshot()`); None where CUDA is not initialized or another allocator
    backend (cudaMallocAsync) serves it."""
    import torch

    if not torch.cuda.is_initialized() or torch.cuda.get_allocator_backend() != "native":  # type: ignore[no-untyped-call]
        return None
    device = torch.cuda.current_device()
    segments = torch.cuda.memory._snapshot().get("segments", [])
    return device, [s for s in segments if int(s.get("device", -1)) == device]


class Resident(NamedTuple):
    """What a script holds when its first compiled graph runs."""

    device: str  # where the parameters live: "cuda" or "cpu"
    allocated: int  # bytes allocated there now
    parameters: int  # of which the live modules' parameters (each storage once)


def resident_bytes() -> Resident:
    """The device the script's parameters live on ("cuda" or "cpu"), the bytes allocated there now (on
    CUDA the caching allocator's count, exact; on the CPU the storages of every tensor Python can
    reach: the parameters, buffers and data the script holds; C++-only allocations are not seen), and
    the parameters' bytes among them."""
    import torch

    from memprof.torch_hooks.known_tensors import live_instances

    params = [p for m in live_instances(torch.nn.Module) for p in m.parameters(recurse=False)]
    on_cuda = any(p.is_cuda for p in params)
    device = "cuda" if on_cuda and torch.cuda.is_initialized() else "cpu"  # type: ignore[no-untyped-call]
    parameters = _storage_bytes(params, device)
    if device == "cuda":
        return Resident(device, int(torch.cuda.memory_allocated()), parameters)
    return Resident(device, _storage_bytes(live_instances(torch.Tensor), "cpu"), parameters)


def held_outputs(roots: Sequence[Any], device_type: str) -> list[tuple[int, int]]:
    """The compiled regions' outputs the script still holds when its first backward is called,
    beside the tensors that backward starts from (`roots`), as (output index, storage bytes) on
    `device_type`, each storage once: a model's logits returned beside its loss and kept in a
    variable (`logits, loss = model(x, y)`), live through the backward and, until the next step's
    forward returns new ones, into the next step. Tensors a compiled region returned have its
    `CompiledFunctionBackward` as `grad_fn`, their index among its outputs as `output_nr`."""
    import torch

    from memprof.torch_hooks.known_tensors import live_instances

    # (the script ends here; what only a reference cycle holds, as Dynamo's tracing of a graph after
    # a break holds that step's logits, goes: a real run frees it whenever a collection runs)
    gc.collect()
    skip = {id(t) for t in roots}
    found: dict[int, tuple[int, int]] = {}
    for t in live_instances(torch.Tensor):
        if id(t) in skip or t.grad_fn is None or type(t.grad_fn).__name__ != "CompiledFunctionBackward":
            continue
        nbytes = _storage_bytes([t], device_type)
        if nbytes:
            found[t.untyped_storage().data_ptr()] = (int(t.output_nr), nbytes)
    return list(found.values())


def _storage_bytes(tensors: Iterable[Any], device_type: str) -> int:
    """Bytes of the storages under those of `tensors` on `device_type`, each once (views and tied
    weights share one)."""
    from torch._subclasses.fake_tensor import FakeTensor

    seen: dict[int, int] = {}
    for t in tensors:
        try:
            # (a compile's fake tensors hold no memory; asking for their storage's address warns)
            if t.device.type == device_type and not t.is_meta and not isinstance(t, FakeTensor):
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (fakes, subclasses)
            continue
    seen.pop(0, None)
    return sum(seen.values())


def cublas_workspaces() -> tuple[int, int]:
    """Bytes of one thread's cuBLAS workspace and of its cuBLASLt one, each made at the thread's
    first matrix multiply on a stream (cuBLASLt's at the first that adds a bias in the multiply,
    `addmm`) and kept, so every step after the first starts with them; (0, 0) off CUDA, or where the
    forward made none. Measured by giving them back (torch makes them again at the next multiply),
    then making them one at a time with small multiplies, and giving them back again: a forward run
    op by op makes the cuBLASLt one wherever its graph has an `addmm`, which Inductor's code may not
    call (the two sizes: 32 MiB and 1 MiB on the H100 and H200 with torch 2.11)."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return 0, 0
    before = int(torch.cuda.memory_allocated())
    clear()
    if before - int(torch.cuda.memory_allocated()) <= 0:
        return 0, 0
    a = torch.ones(16, 16, device="cuda")
    bias = torch.ones(16, device="cuda")
    start = int(torch.cuda.memory_allocated())
    torch.mm(a, a)  # (its output freed at once)
    cublas = max(0, int(torch.cuda.memory_allocated()) - start)
    torch.addmm(bias, a, a)
    lt = max(0, int(torch.cuda.memory_allocated()) - start - cublas)
    clear()
    return cublas, lt
