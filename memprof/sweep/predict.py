"""`memprof sweep --predict`: compile-time predictions of the step peak, with no training step.

The sweep runs one child process per group of budgets (`memprof _sweep-child --predict`). The script
runs under
memprof's compile hooks (no allocation capture) with
`torch._functorch.config.force_non_lazy_backward_lowering`, so each compiled region's backward is
partitioned and compiled together with its forward; the first call of `Tensor.backward` /
`torch.autograd.backward` then stops the script (a script that only calls `torch.autograd.grad`
runs to its end). What ran is the compile and one forward; no backward and no optimizer step. The
predictions are those of `memprof.sweep.measure.estimates` (memprof's walk of the wrapper code,
Inductor's estimate, the partitioner's KnapsackEvaluator).

No kernel is compiled. Inductor compiles every graph as usual, up to its wrapper code (which the
predictions read), but the script runs each compiled graph as its FX graph, op by op (`eager_runs`):
the forward needs its outputs, not its speed, and so no process spends time compiling its kernels.
Kernels are made lazy (`LazyKernel`), so that loading the wrapper code
compiles none; a graph whose op-by-op run fails falls back to its compiled code, whose kernels are
then compiled as they are first called.

Budgets differ only from the partitioner on, so the budgets of one process share everything before
it: the interpreter and imports, the script up to its compile, Dynamo's trace and AOTAutograd's
joint graph. At each compiled region (`aot_stage2_autograd`, AOTAutograd's partition-and-compile
stage), every budget after the first is partitioned and compiled on its own copy of the joint graph
(its compiled function is dropped, never run); then the first budget, which the script runs on
with. Inductor's joint-graph passes, which precede the partitioner, run for the first of these
compiles only; the others partition copies of their output (`_joint_passes_once`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memprof.analysis.caching_allocator import (
    CachingAllocatorModel,
    OptimizerStep,
    model_from_segments,
    settings_modelled,
)
from memprof.sweep.block_peak import FirstCalls
from memprof.sweep.estimate import tangent_nodes
from memprof.sweep.measure import ChildResult, Measured, estimate_fields, estimates, merge_facts, plan_facts
from memprof.sweep.step_estimate import CaptureEstimate, running_torch_version, tangents_held
from memprof.torch_hooks.optimizer_step import optimizer_state_bytes, optimizer_state_requests
from memprof.torch_hooks.patch import Patches
from memprof.torch_hooks.predict import (
    EagerRun,
    LazyKernel,
    Resident,
    allocator_segments,
    cublas_workspaces,
    eager_runs,
    held_outputs,
    lazy_kernels,
    resident_bytes,
    share_joint_graph,
    sharing_available,
    stop_at_backward,
)
from memprof.torch_hooks.tangents import incoming_tangents


class _Stop(BaseException):
    """Raised at the first backward call: everything it needs has been compiled."""


class DeviceTurn:
    """The device taken in turns by the processes of one sweep: each process's compiles run in
    parallel, but from its first run of a compiled graph to the script's end it holds an exclusive
    lock on `path`, so only one forward at a time holds the device's memory (a sweep of a model that
    fills the device, after an OOM, would otherwise run out of memory in its predictions). Before the
    lock is let go, what the script left is collected and the caching allocator gives its cached
    blocks back to the device. The lock goes with the process, however it ends."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: Any = None

    def __call__(self) -> None:
        if self.path is None or self._file is not None:
            return
        import fcntl

        self._file = open(self.path, "a")  # noqa: SIM115 (open until release or the process's exit)
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._file is None:
            return
        import gc

        import torch

        gc.collect()  # the script's tensors in reference cycles
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.empty_cache()
        self._file.close()  # closing the file lets the lock go
        self._file = None


@dataclass
class _Book:
    """Which budget's compile recorded each plan, graph and kernel, and the seconds each one's took."""

    recorder: Any
    kernels: list[LazyKernel] = field(default_factory=list)
    eager: list[EagerRun] = field(default_factory=list)  # (only the budget the script runs with runs its graphs)
    plan_owner: dict[int, float] = field(default_factory=dict)
    graph_owner: dict[int, float] = field(default_factory=dict)
    kernel_owner: dict[int, float] = field(default_factory=dict)
    seconds: dict[float, float] = field(default_factory=dict)
    shared_seconds: float = 0.0  # within `compiling`, but work for every budget (the joint-graph passes)
    errors: dict[float, str] = field(default_factory=dict)
    # the CUDA caching allocator before the first compiled graph ran (device, snapshot segments), and
    # what the optimizers' first step will allocate there (`optimizer_state_requests`)
    segments: tuple[int, list[dict[str, Any]]] | None = None
    optimizer_state: tuple[OptimizerStep, list[str]] | None = None
    # what a step starts from: the bytes allocated when the first compiled graph ran (on the device
    # the parameters live on), and those added before the next step: the optimizers' first-step
    # state and, on CUDA, one thread's cuBLAS and cuBLASLt workspaces (`cublas_workspaces`)
    resident: Resident | None = None
    state_bytes: int = 0
    workspace: tuple[int, int] = (0, 0)
    # the compiled outputs the script held beside its loss at the first backward (`held_outputs`),
    # and the gradients the first compiled backward would be handed (`incoming_tangents`)
    held: list[tuple[int, int]] = field(default_factory=list)
    tangents: list[tuple[list[int], str, bool]] | None = None

    def before_first_run(self) -> None:
        if self.segments is None:
            self.segments = allocator_segments() or (-1, [])
        if self.resident is None:
            self.resident = resident_bytes()

    def at_stop(self, roots: list[Any]) -> None:
        if self.segments is not None and self.segments[0] >= 0:
            self.optimizer_state = optimizer_state_requests(self.segments[0])
        elif self.resident is not None and self.resident.device == "cpu":
            self.optimizer_state = optimizer_state_requests(-1)
        if self.resident is not None:
            # the forward has run: its thread's cuBLAS workspace exists now and stays for every step;
            # the backward runs on the autograd engine's device thread, whose own cuBLAS handle makes
            # another of the same size at its first matrix multiply (the real snapshot
            # tests/fixtures/tiny_snapshot_cuda.pickle shows both: one under the forward's call, one
            # under `_backward_impl`); no backward runs here, so it is counted as the forward's twin
            self.workspace = cublas_workspaces() if self.resident.device == "cuda" else (0, 0)
            self.state_bytes = optimizer_state_bytes(self.resident.device)
            self.held = held_outputs(roots, self.resident.device)
            if tangents_held(running_torch_version()):  # (else no tangent is held: nothing to read)
                self.tangents = incoming_tangents(roots)  # (runs the backward's eager part: last)

    @contextlib.contextmanager
    def compiling(self, budget: float) -> Iterator[None]:
        plans, graphs, kernels = len(self.recorder.plans), len(self.recorder.graphs), len(self.kernels)
        t0, shared = time.perf_counter(), self.shared_seconds
        try:
            yield
        finally:
            own = time.perf_counter() - t0 - (self.shared_seconds - shared)
            self.seconds[budget] = self.seconds.get(budget, 0.0) + own
            self.plan_owner.update(dict.fromkeys(range(plans, len(self.recorder.plans)), budget))
            self.graph_owner.update(dict.fromkeys(range(graphs, len(self.recorder.graphs)), budget))
            self.kernel_owner.update(dict.fromkeys(range(kernels, len(self.kernels)), budget))

    def kernel_counts(self, budget: float) -> tuple[int, int]:
        """(kernels this budget's compile asked for, of which compiled: those the script called)."""
        mine = [k for i, k in enumerate(self.kernels) if self.kernel_owner.get(i) == budget]
        return len(mine), sum(k.is_compiled for k in mine)


def predict(script: str, args: list[str], budgets: Sequence[float], remat: str | None,
            device_lock: Path | None = None) -> list[ChildResult]:
    """One result per budget, in the order given; the first budget is the one the script runs with.
    With `device_lock`, the script's compiled graphs run only while this process holds it (`DeviceTurn`)."""
    from memprof.runner import run_script
    from memprof.torch_hooks.budget import budget_set
    from memprof.torch_hooks.plan_recorder import PlanRecorder

    if not budgets:
        raise ValueError("no budget to predict")
    first, others = budgets[0], list(budgets[1:])
    sharing = sharing_available()
    if others and not sharing:
        raise RuntimeError("this torch has no AOTAutograd stage to share between budgets: predict one per process")
    notes: list[str] = []
    recorder = PlanRecorder(time.perf_counter_ns, notes.append, knapsack_evaluator=True)
    book = _Book(recorder)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as undo:  # undone in reverse
        undo.enter_context(budget_set(first, force_non_lazy_backward_lowering=True))
        if remat:
            from memprof.remat import enable

            undo.enter_context(enable(remat))
        recorder.install()
        undo.callback(recorder.uninstall)
        patches = undo.enter_context(Patches())
        if sharing:  # (with no stage to share, one budget alone still runs, its compile timed as a whole)
            share_joint_graph(patches, book, first, others)
        lazy_kernels(patches, book.kernels)
        turn = DeviceTurn(device_lock)
        undo.callback(turn.release)  # after the script (ExitStack: last in, first out)
        def before_run() -> None:
            turn()
            book.before_first_run()

        eager_runs(patches, book.eager, notes.append, before_run)
        stop_at_backward(patches, _Stop, book.at_stop)
        result = run_script(script, args, stop=_Stop)
    total = time.perf_counter() - t0
    shared = total - sum(book.seconds.values())  # the script, Dynamo, the joint graph: every budget's
    return [_result(recorder, book, b, budgets, remat, result, shared, notes) for b in budgets]


def _allocator(book: _Book, device: str, notes: list[str]) -> tuple[CachingAllocatorModel | None,
                                                                    OptimizerStep | None]:
    """The caching allocator's model as the script left it before its first compiled graph ran, and
    the optimizers' first step to come (on the CPU the step alone, no blocks; None, None: not a CUDA
    run, allocator settings the model does not hold for, or no optimizer state known: the estimate
    then counts requests)."""
    import os

    if device == "cpu" and book.optimizer_state is not None and not book.optimizer_state[1]:
        return None, book.optimizer_state[0]  # (requests, no allocator's blocks: the optimizer step's peak)
    if device != "cuda" or book.segments is None or book.segments[0] < 0 or book.optimizer_state is None:
        return None, None
    if not settings_modelled(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")):
        return None, None
    step, unknown = book.optimizer_state
    if unknown:
        note = (f"memprof's estimate counts requests, not the caching allocator's blocks: the state of "
                f"{', '.join(unknown)} is not modelled")
        if note not in notes:
            notes.append(note)
        return None, None
    return model_from_segments(book.segments[1], book.segments[0]), step


def _first_calls(graphs: Sequence[Any], book: _Book, notes: list[str]) -> FirstCalls | None:
    """What the first step's graph calls will allocate beyond a later step's: each graph's kernels
    that autotune at their first launch, as Inductor's autotune cache stands now (a kernel whose
    best config a run cached does not benchmark again: this process runs its graphs op by op, so
    none of theirs is), each benchmark's cache flush, and the cuBLAS workspaces, made at each
    thread's first matrix multiply (a workspace can take a flush's freed block: the H100's GQA
    decoder). None without Triton."""
    from memprof.torch_hooks.inductor import autotuned_kernels, l2_flush_bytes

    out: dict[tuple[int, str], frozenset[str]] = {}
    unknown = 0
    for g in graphs:
        if g.plan is None or g.role not in ("forward", "backward"):
            continue
        found = autotuned_kernels(str(g.source))
        if found is None:
            return None
        out[(g.plan, g.role)], unknown = found[0], unknown + found[1]
    note = (f"memprof could not tell whether {unknown} Triton kernel(s) autotune at their first launch: their "
            "benchmarks' cache flushes are left out of the caching allocator's model")
    if unknown and note not in notes:
        notes.append(note)
    return FirstCalls(out, l2_flush_bytes(book.segments[0] if book.segments else 0), *book.workspace)


def _kept_tangents(plans: Sequence[Any], incoming: list[tuple[list[int], str, bool]] | None) -> dict[int, list[str]]:
    """The tangents the engine holds through the backward of the pair whose tangents are the gradients
    the first compiled backward would be handed (matched by shape and dtype, one pair alone): on a
    torch that holds them (2.11), those handed contiguous, which AOTAutograd takes as they are (not
    `.sum()`'s expanded ones: it copies those, and frees the copy at the wrapper's `del`). Other
    pairs, and other torch versions, follow the version (`kept_tangents`)."""
    if not incoming or not tangents_held(running_torch_version()):
        return {}
    want = [(shape, dtype) for shape, dtype, _c in incoming]
    match = [i for i, p in enumerate(plans) if [(t.shape, t.dtype) for t in tangent_nodes(p)] == want]
    if len(match) != 1:
        return {}
    names = [t.name for t in tangent_nodes(plans[match[0]])]
    return {match[0]: [n for n, (_s, _d, contiguous) in zip(names, incoming, strict=True) if contiguous]}


def _workspaces(book: _Book, graphs: Sequence[Any]) -> int:
    """The workspaces a step after the first holds: each thread's cuBLAS one (the forward's and the
    autograd engine's), and a cuBLASLt one on each thread whose compiled graphs call `addmm` (the
    run op by op here calls it wherever the FX graph has one; Inductor's code may not: the paper
    BERT's at budget 0 adds every bias in a Triton kernel, at 1.0 one in an `addmm`)."""
    cublas, lt = book.workspace
    lt_threads = {g.role for g in graphs if g.role in ("forward", "backward") and "extern_kernels.addmm(" in g.source}
    return 2 * cublas + lt * len(lt_threads)


def _resident(book: _Book, walk: CaptureEstimate | None, workspaces: int) -> int | None:
    """What a step after the first starts from: the caching allocator's model of it where the
    estimate replayed one (the optimizer's state in the blocks it got, some larger than their
    requests), else what was allocated before the first compiled graph ran plus the state's
    requests; and the `workspaces`, and the outputs the script holds beside its loss."""
    if book.resident is None:
        return None
    held = walk.held_outputs if walk is not None else sum(b for _k, b in book.held)
    if walk is not None and walk.steady_start is not None:  # (the workspaces in the model's blocks, or beside)
        return walk.steady_start + (0 if walk.workspaces_in_blocks else workspaces) + held
    return book.resident.allocated + book.state_bytes + workspaces + held


def _reserved(walk: CaptureEstimate | None, workspaces: int) -> int | None:
    """The caching allocator's reserved bytes by the end of a step after the first, where the
    estimate replayed its model: the model's segments, and a segment per workspace (32 MiB: a
    segment of its own); and the outputs the script holds that no backward saves, whose blocks the
    model gave back when the forward returned (an upper bound: what the model's backward put in
    them may fit in its segments' free space)."""
    if walk is None or walk.steady_reserved is None:
        return None
    held = walk.held_outputs - walk.held_saved
    return walk.steady_reserved + (0 if walk.workspaces_in_blocks else workspaces) + held


def _result(recorder: Any, book: _Book, b: float, budgets: Sequence[float], remat: str | None, result: Any,
            shared: float, notes: list[str]) -> ChildResult:
    """One budget's prediction: its plans (renumbered) and graphs, and what no budget's stage compiled
    (inference graphs)."""
    first = budgets[0]
    keep = [i for i in range(len(recorder.plans)) if book.plan_owner.get(i, b) == b]
    renumber = {old: new for new, old in enumerate(keep)}
    plans = [dataclasses.replace(recorder.plans[i], index=renumber[i]) for i in keep]
    graphs = [dataclasses.replace(g, plan=renumber.get(g.plan) if g.plan is not None else None)
              for j, g in enumerate(recorder.graphs) if book.graph_owner.get(j, b) == b]
    error = book.errors.get(b)
    kernels, compiled = book.kernel_counts(b)
    # (every wrapper defines the name empty_strided_cuda; a CUDA graph calls it)
    device = "cuda" if any("empty_strided_cuda((" in g.source for g in graphs) else "cpu"
    allocator, between = _allocator(book, device, notes)
    first_calls = _first_calls(graphs, book, notes) if allocator is not None and between is not None else None
    workspaces = _workspaces(book, graphs) if device == "cuda" else 0
    found, walk = (estimates(plans, graphs, device, allocator=allocator, between=between, first_calls=first_calls,
                             held=book.held, tangents=_kept_tangents(plans, book.tangents))
                   if error is None else ({}, None))
    est = found.get("memprof")
    if walk is not None and walk.held_saved and walk.phase == "backward" and est is not None:
        found["memprof"] = est - walk.held_saved  # (in the bytes the step starts from: `held_of_pair`)
    explained = estimate_fields(walk)
    ok = result.status in ("stopped", "completed", "exit") and result.exit_code == 0
    if error is not None:
        status, code = "exception", 1
    elif not ok:  # a later region may be missing: every budget of the process shares the script's end
        status, code = result.status, result.exit_code or 1
        error = result.error if b == first else f"{result.error or result.status} (the script, run with {first:g})"
    else:
        status, code = "completed", 0
    own = book.seconds.get(b, 0.0)
    measured = Measured(
        device=device, peak=None, step_peak=None, step_peaks=[], step_ms=None, steps=0, step_source="prediction",
        compiled=bool(plans), plans=len(plans),
        facts=merge_facts([plan_facts(p) for p in plans]) if error is None else None, estimates=found,
        notes=notes, buffer_level=bool(graphs),
        # no capture: what is live at the peak is memprof's estimate's (the step's own allocations)
        at_peak=explained["estimate_at_peak"], peak_phase=explained["estimate_peak_phase"], at_peak_source="estimate",
        # what this budget alone would take: its own partition and compile, and the shared part
        compile_s=round(shared + own, 2), own_compile_s=round(own, 2), shared_s=round(shared, 2),
        resident=_resident(book, walk, workspaces), reserved=_reserved(walk, workspaces),
        parameter_bytes=book.resident.parameters if book.resident else None,
        **explained)
    return ChildResult(b, remat or "off", status, code, error, measured, details={
        "stopped_at_backward": result.status == "stopped", "group": list(budgets), "ran_script": b == first,
        "kernels": kernels, "kernels_compiled": compiled,
        "kernels_autotuning": sum(len(k) for k in first_calls.autotuned.values()) if first_calls else None,
        "l2_flush_bytes": first_calls.flush_bytes if first_calls else None,
        "graphs_run_op_by_op": sum(1 for e in book.eager if e.eager_calls) if b == first else 0})
