"""Recording a capture: the recorder that owns the native session and the run-time hooks, and the one
capture a process may run at a time (`memprof.session` has `memprof.capture()`, `memprof.step()` and
the never-lose-a-capture policy). The recorder fills its `Capture` once, when it stops."""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from memprof import environment, spill
from memprof._events import EVENT_DTYPE, CarriedBlock
from memprof._native import native, ring_events, thread_table
from memprof.analysis.distributed import DDP_BUCKETS_BEGIN, DDP_BUCKETS_END
from memprof.analysis.garbage import GC_START, GC_STOP
from memprof.background import Background
from memprof.capture import Capture
from memprof.capture_info import Keep
from memprof.console import say
from memprof.errors import MemprofError, one_line
from memprof.fileformat import EventSource
from memprof.plans import KnownTensors
from memprof.torch_hooks import graph_breaks, runtime
from memprof.torch_hooks.patch import Patches

# RecordFunction scope sets (csrc/capture.h ScopeBits: function 1, backward 2, user 4; checked
# against `_C.constants()` in a test): "ops" records every aten op, autograd node and Inductor kernel
# launch; "graphs" only compiled-graph calls and user record_function regions (much cheaper: aten
# ops then skip RecordFunction entirely).
SCOPE_BITS = {"ops": 1 | 2 | 4, "graphs": 4, "none": 0}
# The bound on stored events where a capture holds them in memory (no output to stream to, or its spill
# could not be written): 16.7 M events, 56 B each, taken in 1.8 MB chunks as needed. A capture that
# streams to its spill holds what half a second records, however long it runs: no bound unless the
# user sets one.
DEFAULT_MAX_EVENTS = 1 << 24
NO_BOUND = (1 << 63) - 1
_NO_LAST = (1 << 63) - 1  # a step window without an end

_lock = threading.Lock()
_active: Recorder | None = None
_atexit_registered = False
_started = 0  # captures started in this process (a forked child counts its parent's)


class Recorder:
    """One capture's native session and hooks; fills its `Capture` when it stops."""

    def __init__(self, cap: Capture, max_events: int, scopes: str, kernels: bool, plans: bool = True,
                 knapsack_evaluator: bool = False, keep: Keep | None = None) -> None:
        self.cap = cap
        self.keep = keep or Keep()
        self.record_plans = plans
        self.knapsack_evaluator = knapsack_evaluator
        self.plan_recorder: Any = None
        self.max_events = max_events
        self.scopes = scopes
        self.kernels = kernels and scopes == "ops"
        self.thread_ident = threading.get_ident()
        self.native_tid = threading.get_native_id()
        self.pid = os.getpid()
        self.step = 0
        self.explicit_steps = False
        # called with each step's number as it ends, before its marker is recorded (`memprof sweep`
        # takes the machine in turns there: a wait in it falls into the step that ends, not the next)
        self.before_marker: Callable[[int], None] | None = None
        self.stopped = False
        self._breaks_from = 0  # Dynamo's graph breaks before the capture (`graph_breaks.graph_break_mark`)
        self.spill: spill.SpillWriter | None = None
        self.background: Background | None = None
        self._patches = Patches()
        self.meta = environment.base_meta()
        self.children = {"dataloader": 0, "other": 0}  # processes started with multiprocessing
        self._marker_ns: collections.deque[int] = collections.deque(maxlen=self.keep.keep_last + 1)
        self._window_known = self.keep.first <= 1  # known tensors of a step window are final (it opened)

    def _note(self, text: str) -> None:
        self.meta["notes"].append(text)

    def start(self) -> None:
        import torch
        import torch.autograd.profiler as autograd_profiler

        C = native()
        if torch._C._autograd._profiler_enabled() or autograd_profiler._is_profiler_enabled:
            raise MemprofError(
                "torch.profiler is already active; memprof and torch.profiler share PyTorch's profiler "
                "slot, so stop the profiler before starting a capture"
            )
        cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        keep = self.keep
        self.meta.update(environment.devices_at_start(cuda_ready), **environment.distributed_at_start(),
                         **keep.to_meta(), max_events=_meta_bound(self.max_events), scopes=self.scopes,
                         kernel_scopes=self.kernels)
        try:
            C.start(self.max_events, SCOPE_BITS[self.scopes], first_step=keep.first, last_step=keep.last or _NO_LAST,
                    keep_last=keep.keep_last)
        except RuntimeError as exc:
            raise MemprofError(str(exc)) from None
        self.meta["t_start_ns"] = int(C.now_ns())
        self._breaks_from = graph_breaks.graph_break_mark()
        global _started
        self.meta["first_in_process"] = _started == 0  # (no CPU block of an earlier capture can be freed in it)
        _started += 1
        try:
            self._install(torch, C, cuda_ready)
        except BaseException:
            self._patches.undo()
            C.stop()
            raise

    def _install(self, torch: Any, C: Any, cuda_ready: bool) -> None:
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        # CUDA: the allocator tracker (requested sizes, streams, segments, OOM).
        if C.cuda_built():
            if cuda_ready:
                self._attach_tracker()
            elif torch.cuda.is_available():
                torch.cuda._lazy_call(self._attach_tracker)
                self.meta["cuda_tracker"] = "pending (CUDA not initialized at start)"
        elif torch.cuda.is_available():
            self.meta["cuda_tracker"] = "not built (CPU-only build of memprof)"
            self._note("memprof was built without CUDA: reserved bytes, requested sizes and streams are missing")
        p = self._patches
        watch = runtime.TangentWatch(self._backward_tangents, self._tangents_kept) if self.record_plans else None
        if self.kernels:  # Inductor's own scopes: every compiled-graph call and every kernel launch
            runtime.kernel_scopes(p)
        # else memprof's scope around each compiled-graph call, no scope per kernel launch: the join
        # finds each buffer's kernel in the wrapper code, and a scope per launch (Python, on the
        # launch path) was most of what the default capture cost a host-bound step; the ops in a
        # call run quiet, but for those that allocate (the rest of that cost)
        op_scope = None if self.kernels or self.scopes == "none" else self.scopes == "ops"
        if op_scope is not None or watch is not None:
            runtime.on_first_compile(p, lambda: runtime.graph_call_scopes(p, op_scope, quiet=C, watch=watch))
        # Compile plans: partitioner decisions, wrapper code and buffer origins of every
        # graph compiled during the capture, and which tensors are parameters and state.
        if self.record_plans:
            from memprof.torch_hooks.plan_recorder import PlanRecorder

            self.plan_recorder = PlanRecorder(C.now_ns, self._note, self.knapsack_evaluator, fx_cache=True)
            runtime.on_first_compile(p, self._install_plans)
            if self.meta.get("preexisting"):  # name what was allocated before the capture
                try:
                    self.plan_recorder.record_modules()
                except Exception as exc:  # never fail the capture over names
                    self._note(f"modules not scanned at the start ({one_line(exc)})")
            self.meta["plans"] = "recorded"
        else:
            self.meta["plans"] = "off"
        # marks around every collection of Python's cyclic garbage collector (what it frees is told
        # apart: garbage.gc_freed_positions) and DDP's bucket allocations (analysis.distributed)
        runtime.on_gc(p, lambda start: C.mark(GC_START if start else GC_STOP))
        runtime.on_ddp_buckets(p, lambda begin: C.mark(DDP_BUCKETS_BEGIN if begin else DDP_BUCKETS_END))
        runtime.on_process_start(p, self._on_process_start)
        runtime.on_recompile_limit(p, lambda what: self.meta.setdefault("recompile_limits", []).append(what))
        # steps: one marker per optimizer step unless the script calls memprof.step()
        runtime.on_optimizer_step(p, self._on_optimizer_step)
        runtime.on_profiler_start(p, self._on_profiler_start)

    def start_spill(self, fd: int, path: Path, meta: dict[str, Any]) -> None:
        """Stream what this session records to the claimed spill `path` (`memprof.spill`) until it stops."""
        try:
            self.spill = spill.SpillWriter(fd, path, native(), {**self.meta, **meta, "native_tid": self.native_tid},
                                           self._recorded, ring=bool(self.keep.keep_last),
                                           bound_on_failure=DEFAULT_MAX_EVENTS)
        except OSError as exc:
            os.close(fd)
            self.remove_spill(path)
            say(f"memprof: warning: no spill at {path} ({exc.strerror or exc}): the capture is kept in memory "
                "only (a kill would lose it)")

    def _recorded(self) -> spill.Recorded:
        rec = self.plan_recorder
        if rec is None:
            return spill.Recorded([], [], KnownTensors(), 0)
        # before a step window opens the records are still pruned (`_bound_known`): none go to the spill yet
        pruned = rec.tensors_pruned  # (read first: a prune in between shows as a change the next time)
        pending = self.keep.last is not None and not self._window_known
        return spill.Recorded(rec.plans, rec.graphs, KnownTensors() if pending else rec.tensors, pruned)

    def remove_spill(self, path: Path | None = None) -> None:
        path = path or (self.spill.path if self.spill is not None else None)
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()

    def _backward_tangents(self, key: str) -> tuple[int, list[tuple[int, str]]] | None:
        """A compiled backward's plan index and its tangents' (input position, name); None for
        another graph (`runtime.TangentWatch`)."""
        rec = self.plan_recorder
        graph = next((g for g in reversed(rec.graphs) if g.key == key), None) if rec is not None else None
        if graph is None or graph.role != "backward" or graph.plan is None or graph.plan >= len(rec.plans):
            return None
        from memprof.sweep.estimate import tangent_nodes

        plan = rec.plans[graph.plan]
        tangents = {n.name for n in tangent_nodes(plan)}
        placeholders = [n.name for n in plan.backward.nodes if n.op == "placeholder"]
        return graph.plan, [(i, name) for i, name in enumerate(placeholders) if name in tangents]

    def _tangents_kept(self, plan: int, names: list[str]) -> None:
        self.meta.setdefault("tangents_kept", {})[str(plan)] = names

    def _install_plans(self) -> None:
        if self.stopped:  # a stale reference to the torch.compile wrapper, called after the capture
            return
        self.plan_recorder.install()
        self._patches.on_undo(self.plan_recorder.uninstall)

    def _on_process_start(self, dataloader: bool) -> None:
        # DataLoader workers above all allocate where no capture sees: count them so the capture says so
        if _active is self:
            self.children["dataloader" if dataloader else "other"] += 1

    def _on_profiler_start(self) -> None:
        """torch.profiler starting during the capture: stop the capture cleanly first."""
        if _active is self and threading.get_ident() == self.thread_ident:
            self.meta["stopped_by"] = "torch.profiler"  # Capture.caveats says so at the top
            say("memprof: the script started torch.profiler, which shares PyTorch's profiler slot with "
                "memprof: the capture stopped there; later events are not captured")
            stop_active()

    def _attach_tracker(self) -> None:
        environment.tracker_attached(self.meta, native().attach_cuda_tracker(), self._note)

    def _on_optimizer_step(self, optimizer: Any) -> None:
        if self.plan_recorder is not None:
            try:
                self.plan_recorder.record_optimizer(optimizer)
            except Exception as exc:  # never break the user's step
                self._note(f"optimizer state not recorded ({one_line(exc)})")
        if not self.explicit_steps:
            self.mark_step(source="optimizer")

    def mark_step(self, source: str) -> int:
        self.step += 1
        self.meta["step_source"] = source
        if self.before_marker is not None:
            self.before_marker(self.step)
        native().mark_step(self.step)
        environment.note_backend(self.meta)
        if self.plan_recorder is not None and (self.keep.last is not None or self.keep.keep_last):
            self._bound_known()
        if self.keep.exit_after and self.keep.last is not None and self.step >= self.keep.last:
            self.meta["ended_by"] = "exit-after"
            say(f"memprof: steps {self.keep.first}-{self.keep.last} are recorded: ending the script "
                "(--exit-after)")
            raise SystemExit(0)
        return self.step

    def _bound_known(self) -> None:
        """Known tensors for the stored steps only: none after a window closed, and before a window opens
        or behind a ring only those that may name a carried block (`PlanRecorder.prune_tensors`)."""
        rec, keep, step = self.plan_recorder, self.keep, self.step
        if keep.last is not None:
            if step >= keep.last:
                rec.record_tensors = False
            elif step <= keep.first - 1 and (step % 32 == 0 or step == keep.first - 1):
                rec.prune_tensors(int(native().now_ns()))
                self._window_known = step == keep.first - 1  # the window opened: its records may spill
            return
        self._marker_ns.append(int(native().now_ns()))
        if len(self._marker_ns) > keep.keep_last and step % keep.keep_last == 0:
            rec.prune_tensors(self._marker_ns[0])  # the marker the ring starts at

    def stop(self, dying: bool = False) -> None:
        """End the session and fill the capture. `dying`: the process is about to die by a signal and the
        session was frozen (`_C.freeze`) on another thread: the hooks stay in place, inert."""
        self.stopped = True
        if self.background is not None and not dying:  # (a dying session is stopped on that thread)
            self.background.stop()
        if self.spill is not None:
            self.spill.close()  # what was recorded up to here is on disk before the session ends
        rec = self.plan_recorder
        if rec is not None and not rec.installed and runtime.dynamo_frames_compiled():
            self._note("Dynamo compiled during the capture without a torch.compile call (torch._dynamo.optimize?): "
                       "memprof's compile hooks wait for torch.compile, so no compile plans were recorded")
        C = native()
        warning = ""
        if not dying:
            try:
                warning = C.stop()
            finally:
                self._patches.undo()
        if warning:
            self._note(warning)
        raw, carried = self._events()
        dropped = int(C.dropped())
        threads = thread_table()
        main = [t["index"] for t in threads if t["tid"] == self.native_tid]
        self.meta.update(
            t_stop_ns=int(C.stop_ns()), t_start_ns=int(C.start_ns()), dropped_events=dropped,
            max_events=_meta_bound(int(C.max_events())),
            first_dropped_ns=int(C.first_dropped_ns()) if dropped else None,
            cpu_threads=C.cpu_all_threads_problem() or "all", dataloader_workers=self.children["dataloader"],
            child_processes=self.children["other"], steps=self.step, main_thread=main[0] if main else None,
            window_state=C.window_state())
        self.meta.setdefault("step_source", None)
        breaks = graph_breaks.graph_breaks_since(self._breaks_from)
        if breaks:
            self.meta["graph_breaks"] = breaks
        environment.note_backend(self.meta)
        strings = list(C.strings())
        C.release()
        tensors = [] if rec is None else self.spill.session_tensors(rec.tensors) if self.spill else list(rec.tensors)
        self.cap.set_recorded(raw, strings, self.meta, threads, list(rec.plans) if rec else [],
                              list(rec.graphs) if rec else [], tensors, carried)

    def _events(self) -> tuple[np.ndarray | EventSource, list[CarriedBlock]]:
        """Every event and where the carried blocks were allocated: the ring's (what was carried into it,
        then its own), or the spill's and the store's tail where the store freed some (read when first used),
        or the store's."""
        C = native()
        if self.keep.keep_last:
            return ring_events()
        raw = self.spill.session_events() if self.spill is not None else np.asarray(C.events()).view(EVENT_DTYPE)
        return raw, CarriedBlock.from_native(C.window_context())


def _meta_bound(max_events: int) -> int:
    """`max_events` as the file records it: 0 for no bound."""
    return 0 if max_events >= NO_BOUND else max_events


def _at_exit() -> None:
    """Interpreter exit with a capture still open (a `capture()` entered and never left): stop it
    with a warning line instead of a traceback, then stop every hook for good."""
    if _active is not None and _active.meta.get("pid") == os.getpid():  # not a forked child's copy
        say("memprof: warning: a capture was still open at interpreter exit; it was stopped there "
            "(nothing is saved unless the script saves it)")
        with contextlib.suppress(Exception):
            stop_active()
    native().shutdown()


def stop_active() -> None:
    global _active
    with _lock:
        rec, _active = _active, None
    if rec is not None:
        rec.stop()


def activate(rec: Recorder) -> None:
    """Start `rec` as the process's one capture (a one-line error while another runs)."""
    global _active
    with _lock:
        if _active is not None:
            raise MemprofError("a memprof capture is already active in this process")
        rec.start()
        _active = rec


def current() -> Recorder | None:
    return _active


def active() -> bool:
    """Whether a capture is running in this process."""
    return _active is not None
