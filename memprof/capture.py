"""Capturing allocations: `memprof.capture()`, the `Capture` result and step markers."""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import gc
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memprof import __version__
from memprof._events import EVENT_DTYPE, KIND_NAMES, Kind, device_name
from memprof._native import native
from memprof.errors import IncompleteCaptureError, MemprofError, one_line
from memprof.plans import CompiledGraph, Plan
from memprof.timeline import (
    GC_START,
    GC_STOP,
    StepStat,
    Timeline,
    build_timeline,
    gc_freed_positions,
    scope_stack_at,
    step_stats,
)

# RecordFunction scope sets (csrc/capture.h ScopeBits): "ops" records every aten op,
# autograd node and Inductor kernel launch; "graphs" only compiled-graph calls and user
# record_function regions (much cheaper: aten ops then skip RecordFunction entirely).
SCOPE_BITS = {"ops": 1 | 2 | 4, "graphs": 4, "none": 0}
DEFAULT_MAX_EVENTS = 1 << 24  # 16.7 M events, 56 B each; memory is taken in 1.8 MB chunks as needed


@dataclass(frozen=True)
class LiveAllocation:
    """One allocation live at a point of the timeline."""

    ptr: int
    bytes: int
    t_ns: int  # allocation time (steady clock)
    scope: str  # innermost op or kernel that allocated it ("" if none)
    thread: int
    requested: int  # requested bytes (CUDA tracker), -1 if unknown
    stream: int
    row: int  # index into Capture.events


class Capture:
    """An exact allocation timeline: events, strings, threads and metadata.

    Returned (still empty) by `memprof.capture()` and filled when the capture stops;
    `memprof.load()` returns a filled one.
    """

    def __init__(
        self,
        raw: np.ndarray | None = None,
        strings: list[str] | None = None,
        meta: dict[str, Any] | None = None,
        threads: list[dict[str, Any]] | None = None,
        plans: list[Plan] | None = None,
        graphs: list[CompiledGraph] | None = None,
        tensors: list[tuple[int, str, int, int, str, str]] | None = None,
    ) -> None:
        self._raw = raw
        self.plans: list[Plan] = plans if plans is not None else []
        """One entry per compiled forward/backward pair (budget, saved, recomputed, random ops)."""
        self.graphs: list[CompiledGraph] = graphs if graphs is not None else []
        """The graphs Inductor compiled during the capture, with their wrapper code."""
        self.tensors: list[tuple[int, str, int, int, str, str]] = tensors if tensors is not None else []
        """Known tensors: (t_ns, device, ptr, bytes, category, name) for parameters, gradients, state."""
        self._labels: dict[str, Any] = {}
        self.strings: list[str] = strings if strings is not None else [""]
        self.meta: dict[str, Any] = meta if meta is not None else {}
        self.threads: list[dict[str, Any]] = threads if threads is not None else []
        self._timelines: dict[str, Timeline] = {}
        self._events: np.ndarray | None = None

    # -- data ---------------------------------------------------------------------------
    @property
    def raw(self) -> np.ndarray:
        """The events as stored (numeric columns; `scope` indexes `strings`)."""
        if self._raw is None:
            raise MemprofError("the capture is still running; its events are available after it stops")
        return self._raw

    @property
    def recording(self) -> bool:
        return self._raw is None

    @property
    def events(self) -> np.ndarray:
        """One row per event: t_ns, seq, kind, bytes, device, scope, thread, ptr, stream, requested.

        `kind`, `device` and `scope` are strings (object columns); `bytes` is positive for an
        allocation and negative for a free.
        """
        if self._events is None:
            raw = self.raw
            kinds = np.array([KIND_NAMES.get(k, f"kind{k}") for k in range(256)], dtype=object)
            names = np.array(self.strings, dtype=object)
            codes = (raw["device_type"].astype(np.int32) + 1) * 256 + raw["device_index"].astype(np.int32) + 1
            uniq, inverse = np.unique(codes, return_inverse=True)
            dev_names = np.array([device_name(int(c) // 256 - 1, int(c) % 256 - 1) for c in uniq], dtype=object)
            out = np.zeros(len(raw), dtype=[
                ("t_ns", "i8"), ("seq", "i8"), ("kind", "O"), ("bytes", "i8"), ("device", "O"),
                ("scope", "O"), ("thread", "i4"), ("ptr", "u8"), ("stream", "u8"), ("requested", "i8"),
            ])
            out["t_ns"] = raw["t_ns"]
            out["seq"] = np.arange(len(raw))
            out["kind"] = kinds[raw["kind"]]
            out["bytes"] = raw["bytes"]
            out["device"] = dev_names[inverse.reshape(-1)]
            out["scope"] = names[raw["scope"]]
            out["thread"] = raw["thread"]
            out["ptr"] = raw["ptr"]
            out["stream"] = raw["stream"]
            out["requested"] = np.where(raw["kind"] == Kind.ALLOC, raw["aux"], -1)
            self._events = out
        return self._events

    @property
    def devices(self) -> list[str]:
        """Devices with allocations or a baseline, CPU first."""
        raw = self.raw
        mem = np.isin(raw["kind"], [Kind.ALLOC, Kind.FREE, Kind.CUDA_ALLOC, Kind.CUDA_FREE_REQUESTED])
        pairs = {(int(t), int(i)) for t, i in zip(raw["device_type"][mem], raw["device_index"][mem], strict=True)}
        names = {device_name(t, i) for t, i in pairs} | set(self.meta.get("baselines", {}))
        return sorted(names, key=lambda d: (d != "cpu", d))

    @property
    def main_device(self) -> str:
        """The device a plain `peak()` refers to: the first CUDA device in use, else the CPU."""
        devices = self.devices
        cuda = [d for d in devices if d != "cpu"]
        return cuda[0] if cuda else (devices[0] if devices else "cpu")

    @property
    def dropped(self) -> int:
        """Events that did not fit in `max_events` (0: none; all events after the first drop are missing)."""
        return int(self.meta.get("dropped_events", 0))

    @property
    def exact(self) -> bool:
        """Whether the capture's peak is the script's exact peak: no event was dropped and the capture
        was not stopped before the script ended (by torch.profiler starting)."""
        return not self.dropped and not self.meta.get("stopped_by")

    @property
    def caveats(self) -> list[str]:
        """What limits the capture's figures, one line each, most important first (empty: none).

        Reporters print these next to the headline figures, not at the bottom."""
        meta, out = self.meta, []
        t0 = int(meta.get("t_start_ns", 0))
        if self.dropped:
            first = meta.get("first_dropped_ns")
            when = f" from {(int(first) - t0) / 1e9:.2f} s on" if isinstance(first, int) and first >= 0 else ""
            steps = int(meta.get("steps") or 0)
            kept = int((self.raw["kind"] == Kind.STEP).sum()) if steps else 0
            of_steps = f"; {kept} of the {steps} steps were captured whole" if steps else ""
            out.append(f"INCOMPLETE: {self.dropped:,} events were dropped{when} (max_events="
                       f"{int(meta.get('max_events') or 0):,}){of_steps}: every peak is a lower bound; "
                       "raise --max-events")
        if meta.get("stopped_by"):
            stop = meta.get("t_stop_ns")
            at = f" at {(int(stop) - t0) / 1e9:.2f} s" if isinstance(stop, int) else ""
            out.append(f"INCOMPLETE: the capture stopped{at} when the script started {meta['stopped_by']} "
                       "(they share PyTorch's profiler slot): later allocations are not captured, so the "
                       "peak is the peak up to there")
        threads = meta.get("cpu_threads")
        if isinstance(threads, str) and threads != "all":
            out.append(f"cpu: only the capturing thread and its autograd threads were seen ({threads}); "
                       "allocations and frees on other threads are missing")
        workers = int(meta.get("dataloader_workers") or 0)
        if workers:
            out.append(f"{workers} DataLoader worker process(es) ran (num_workers > 0): what they allocate is in "
                       "other processes, and the batches they hand over arrive in shared memory, which no "
                       "PyTorch allocator reports; neither is captured")
        limits = meta.get("recompile_limits")
        if isinstance(limits, list) and limits:
            out.append(f"Dynamo hit {str(limits[0])[:200]}: later calls of that code ran eagerly, not compiled, "
                       "so their memory is the eager run's" + (f" ({len(limits)} such frames)" if len(limits) > 1
                                                               else ""))
        children = int(meta.get("child_processes") or 0)
        if children:
            out.append(f"{children} other child process(es) started with multiprocessing: their allocations "
                       "are not captured")
        return out

    def scope_name(self, scope_id: int) -> str:
        return self.strings[scope_id] if 0 <= scope_id < len(self.strings) else f"<scope {scope_id}>"

    # -- analysis -----------------------------------------------------------------------
    def timeline(self, device: str | None = None) -> Timeline:
        """Live bytes (and reserved bytes, on CUDA) after every event on one device."""
        device = device or self.main_device
        if device not in self._timelines:
            base = self.meta.get("baselines", {}).get(device, {})
            has_reserved = device != "cpu" and self.meta.get("cuda_tracker") == "attached"
            self._timelines[device] = build_timeline(
                self.raw, device, int(base.get("allocated", 0)), int(base.get("reserved", 0)), has_reserved
            )
        return self._timelines[device]

    def _check_exact(self, what: str) -> None:
        if self.dropped:
            raise IncompleteCaptureError(
                f"{what}: the capture dropped {self.dropped:,} events after max_events="
                f"{int(self.meta.get('max_events') or 0):,}, so its peak is only a lower bound; pass "
                "lower_bound=True to get the bound, or capture again with a larger max_events")

    def peak(self, device: str | None = None, step: int | None = None, *, lower_bound: bool = False) -> int:
        """Exact peak live bytes on a device, over the capture or within one step.

        A capture that dropped events (`dropped`) has no exact peak: this raises
        IncompleteCaptureError unless `lower_bound` is set, which returns the peak of the events kept
        (a lower bound). Steps that ended before the first drop are whole and exact either way."""
        if step is None:
            if not lower_bound:
                self._check_exact("no exact peak")
            return self.timeline(device).peak
        for s in self.steps(device):
            if s.step == step:
                return s.peak
        raise MemprofError(f"no step {step} in this capture (steps: {[s.step for s in self.steps(device)]})")

    def steps(self, device: str | None = None, tail: bool | None = None) -> list[StepStat]:
        """Per-step statistics, split at the step markers (the step numbers the script made).

        The events after the last marker are a step (incomplete) only when the capture stopped
        inside one: the script raised, was interrupted or ran out of memory, events were dropped or
        torch.profiler stopped the capture; after a normal end they are the script's wrap-up, not a
        step. `tail` overrides that choice."""
        if tail is None:
            tail = (self.meta.get("status") not in (None, "completed", "exit")
                    or not self.exact)
        return step_stats(self.raw, self.timeline(device), int(self.meta.get("t_start_ns", 0)),
                          int(self.meta.get("t_stop_ns", 0)), tail)

    def live_at(self, device: str | None = None, pos: int | None = None) -> list[LiveAllocation]:
        """Captured allocations live just after timeline position `pos` (default: the peak), largest first."""
        tl = self.timeline(device)
        if pos is None:
            pos = tl.peak_pos
        raw = self.raw
        live = tl.live_positions(pos) if pos >= 0 else np.zeros(0, np.int64)
        rows, sizes = tl.rows[live], tl.delta[live]
        order = np.argsort(-sizes, kind="stable")
        return [
            LiveAllocation(
                ptr=int(raw["ptr"][r]), bytes=int(sizes[i]), t_ns=int(raw["t_ns"][r]),
                scope=self.scope_name(int(raw["scope"][r])), thread=int(raw["thread"][r]),
                requested=int(raw["aux"][r]) if raw["kind"][r] == Kind.ALLOC else -1,
                stream=int(raw["stream"][r]), row=int(r),
            )
            for i, r in ((int(i), int(rows[i])) for i in order)
        ]

    def gc_freed(self, device: str | None = None) -> np.ndarray:
        """Timeline positions (`timeline(device)`) of the frees Python's cyclic garbage collector made
        during the capture: tensors that lived in reference cycles (`timeline.gc_freed_positions`)."""
        return gc_freed_positions(self.raw, self.timeline(device), self.strings)

    def live_at_peak(self, device: str | None = None) -> list[LiveAllocation]:
        """The live set at the device's peak: each live allocation with bytes, time and scope."""
        return self.live_at(device, None)

    def labels(self, device: str | None = None) -> Any:
        """Category, FX node, layer and kernel of every allocation on a device (memprof.attribution)."""
        from memprof.attribution import label_timeline

        device = device or self.main_device
        if device not in self._labels:
            main = self.meta.get("main_thread")
            pre = [(int(p), int(b)) for p, b in self.meta.get("preexisting", {}).get(device, [])]
            self._labels[device] = label_timeline(self.raw, self.strings, self.timeline(device), self.plans,
                                                  self.graphs, self.tensors, None if main is None else int(main),
                                                  pre)
        return self._labels[device]

    def attribution(self, at: str = "peak", by: str = "category", device: str | None = None, *,
                    lower_bound: bool = False) -> list[Any]:
        """What is live at a point, grouped: rows with key, bytes, count, share (and category).

        `at` is "peak" or "step:N" (the peak within step N, as `steps()` finds it); `by` is
        "category", "node", "layer" or "kernel". The rows sum exactly to the live bytes at that point.
        At "peak", a capture that dropped events raises IncompleteCaptureError unless `lower_bound`
        (the peak of the events kept, not the script's).
        """
        from memprof.attribution import BY, point_of, rows_at

        if by not in BY:
            raise MemprofError(f"by must be one of {', '.join(BY)}, got {by!r}")
        if at == "peak" and not lower_bound:
            self._check_exact("no exact peak to attribute")
        tl = self.timeline(device)
        try:
            pos = point_of(tl, at, [(s.step, s.peak_pos) for s in self.steps(device)])
        except ValueError as exc:
            raise MemprofError(str(exc)) from None
        return rows_at(tl, self.labels(device), pos, by)

    def scope_stack_at_peak(self, device: str | None = None) -> list[str]:
        """The op/kernel scopes open on the peak's thread when the peak was reached (outermost first);
        the capturing thread's when the peak's thread had none open (a worker thread's allocation)."""
        tl = self.timeline(device)
        if tl.peak_pos < 0:
            return []
        stack = scope_stack_at(self.raw, int(tl.rows[tl.peak_pos]), self.meta.get("main_thread"))
        return [self.scope_name(s) for s in stack]

    # -- files --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the capture to a .memprof file (atomically); returns the path."""
        from memprof.fileformat import save

        return save(self, Path(path))

    def __repr__(self) -> str:
        if self.recording:
            return "<memprof.Capture (recording)>"
        return f"<memprof.Capture {len(self.raw)} events, devices {self.devices}>"


# -- recording --------------------------------------------------------------------------

_lock = threading.Lock()
_active: _Recorder | None = None
_atexit_registered = False


def _base_meta() -> dict[str, Any]:
    import torch

    return {
        "memprof_version": __version__,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "pid": os.getpid(),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "notes": [],
    }


class _Recorder:
    def __init__(self, cap: Capture, max_events: int, scopes: str, kernels: bool, plans: bool = True,
                 knapsack_evaluator: bool = False) -> None:
        self.cap = cap
        self.record_plans = plans
        self.knapsack_evaluator = knapsack_evaluator
        self.plan_recorder: Any = None
        self.max_events = max_events
        self.scopes = scopes
        self.kernels = kernels and scopes != "none"
        self.thread_ident = threading.get_ident()
        self.native_tid = threading.get_native_id()
        self.step = 0
        self.explicit_steps = False
        self._undo: list[Callable[[], None]] = []
        self.meta = _base_meta()
        self.children = {"dataloader": 0, "other": 0}  # processes started with multiprocessing

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
        baselines: dict[str, dict[str, int]] = {"cpu": {"allocated": 0, "reserved": 0}}
        cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if cuda_ready:
            self.meta["preexisting"] = _live_blocks(torch)
            for d in range(torch.cuda.device_count()):
                baselines[f"cuda:{d}"] = {
                    "allocated": int(torch.cuda.memory_allocated(d)),
                    "reserved": int(torch.cuda.memory_reserved(d)),
                }
        self.meta["baselines"] = baselines
        self.meta["max_events"] = self.max_events
        self.meta["scopes"] = self.scopes
        self.meta["kernel_scopes"] = self.kernels
        self.meta["cpu_note"] = "cpu: bytes allocated during the capture (PyTorch does not report earlier ones)"
        if torch.cuda.is_available():
            self.meta["allocator_backend"] = torch.cuda.get_allocator_backend()
        try:
            C.start(self.max_events, SCOPE_BITS[self.scopes])
        except RuntimeError as exc:
            raise MemprofError(str(exc)) from None
        self.meta["t_start_ns"] = int(C.now_ns())
        try:
            self._install(torch, autograd_profiler, C, cuda_ready)
        except BaseException:
            self._uninstall()
            C.stop()
            raise

    def _install(self, torch: Any, autograd_profiler: Any, C: Any, cuda_ready: bool) -> None:
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
        # Inductor wraps compiled graphs and Triton launches in RecordFunction scopes
        # only while this flag is set; turn it on for the capture.
        if self.kernels:
            previous = autograd_profiler._is_profiler_enabled
            autograd_profiler._set_is_profiler_enabled(True)
            self._undo.append(lambda: autograd_profiler._set_is_profiler_enabled(previous))
        # Compile plans: partitioner decisions, wrapper code and buffer origins of every
        # graph compiled during the capture, and which tensors are parameters and state.
        if self.record_plans:
            from memprof.compile_hooks import PlanRecorder

            self.plan_recorder = PlanRecorder(C.now_ns, self._note, self.knapsack_evaluator)
            self.plan_recorder.install()
            self._undo.append(self.plan_recorder.uninstall)
            if self.meta.get("preexisting"):  # name what was allocated before the capture
                try:
                    self.plan_recorder.record_modules()
                except Exception as exc:  # never fail the capture over names
                    self._note(f"modules not scanned at the start ({one_line(exc)})")
            self.meta["plans"] = "recorded (Inductor and AOTAutograd caches off during the capture)"
        else:
            self.meta["plans"] = "off"
        # Python's cyclic garbage collector: a mark at the start and stop of every collection, so that
        # what it frees (tensors held in reference cycles, freed whenever a collection happens to run)
        # is told apart from frees at a tensor's last reference (timeline.gc_freed_positions)
        def on_gc(phase: str, info: dict[str, Any]) -> None:
            C.mark(GC_START if phase == "start" else GC_STOP)

        gc.callbacks.append(on_gc)
        self._undo.append(lambda: gc.callbacks.remove(on_gc))
        self._count_child_processes()
        self._watch_recompile_limits()
        # Steps: one marker per optimizer step unless the script calls memprof.step().
        from torch.optim.optimizer import register_optimizer_step_post_hook

        handle = register_optimizer_step_post_hook(self._on_optimizer_step)
        self._undo.append(handle.remove)
        # torch.profiler starting during the capture: stop the capture cleanly first.
        original = autograd_profiler._run_on_profiler_start

        def run_on_profiler_start() -> None:
            if _active is self and threading.get_ident() == self.thread_ident:
                message = ("the script started torch.profiler, which shares PyTorch's profiler slot "
                           "with memprof: the capture stopped there; later events are not captured")
                self.meta["stopped_by"] = "torch.profiler"  # Capture.caveats says so at the top
                print(f"memprof: {message}", file=sys.stderr)
                _stop_active()
            original()

        autograd_profiler._run_on_profiler_start = run_on_profiler_start
        self._undo.append(lambda: setattr(autograd_profiler, "_run_on_profiler_start", original))

    def _count_child_processes(self) -> None:
        """Child processes (DataLoader workers above all) allocate where no capture sees: count the
        ones started with multiprocessing so the capture can say so."""
        import multiprocessing.process as mp_process

        original_start = mp_process.BaseProcess.start
        recorder = self

        def start(proc: Any) -> None:
            if _active is recorder:
                target = getattr(getattr(proc, "_target", None), "__module__", "") or ""
                recorder.children["dataloader" if target.startswith("torch.utils.data") else "other"] += 1
            original_start(proc)

        mp_process.BaseProcess.start = start  # type: ignore[method-assign,assignment]
        self._undo.append(lambda: setattr(mp_process.BaseProcess, "start", original_start))

    def _watch_recompile_limits(self) -> None:
        """Dynamo giving up on a frame (its recompile limit) runs it eagerly from then on: the capture
        is still exact, but of a program the user did not mean to run; say so (a log handler only reads)."""
        import logging

        recorder_meta = self.meta

        class RecompileLimit(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
                    with contextlib.suppress(Exception):
                        first = record.getMessage().splitlines()
                        where = next((ln.strip() for ln in first if ln.strip().startswith("function:")), "")
                        recorder_meta.setdefault("recompile_limits", []).append(
                            f"{first[0].removeprefix('torch._dynamo hit ')}{', ' + where if where else ''}")

        handler = RecompileLimit(logging.WARNING)
        dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
        dynamo_log.addHandler(handler)
        self._undo.append(lambda: dynamo_log.removeHandler(handler))

    def _attach_tracker(self) -> None:
        import torch

        C = native()
        problem = C.attach_cuda_tracker()
        if not problem:
            self.meta["cuda_tracker"] = "attached"
            for d in range(torch.cuda.device_count()):
                self.meta["baselines"].setdefault(f"cuda:{d}", {"allocated": 0, "reserved": 0})
            return
        self.meta["cuda_tracker"] = f"unavailable: {problem}"
        backend = torch.cuda.get_allocator_backend()
        if backend == "cudaMallocAsync":
            self._note("the cudaMallocAsync allocator backend supports no allocator tracing, and on torch "
                       "2.11 it reports no CUDA allocations to PyTorch's memory reporter either: memprof "
                       "captures CPU allocations and scopes only; use the default (native) backend")
        else:
            self._note(f"CUDA allocator tracing unavailable ({problem}): reserved bytes are missing")

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
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
        native().mark_step(self.step)
        return self.step

    def _uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def stop(self) -> None:
        C = native()
        warning = ""
        try:
            warning = C.stop()
        finally:
            self._uninstall()
        if warning:
            self._note(warning)
        raw = np.asarray(C.events()).view(EVENT_DTYPE)
        self.meta["t_stop_ns"] = int(C.stop_ns())
        self.meta["t_start_ns"] = int(C.start_ns())
        self.meta["dropped_events"] = int(C.dropped())
        self.meta["first_dropped_ns"] = int(C.first_dropped_ns()) if self.meta["dropped_events"] else None
        problem = C.cpu_all_threads_problem()
        self.meta["cpu_threads"] = problem or "all"
        self.meta["dataloader_workers"] = self.children["dataloader"]
        self.meta["child_processes"] = self.children["other"]
        self.meta.setdefault("step_source", None)
        self.meta["steps"] = self.step
        threads = [{"index": i, "tid": tid, "name": name} for i, tid, name in C.threads()]
        main = [t["index"] for t in threads if t["tid"] == self.native_tid]
        self.meta["main_thread"] = main[0] if main else None
        strings = list(C.strings())
        C.release()
        self.cap.meta.update({**self.meta, **self.cap.meta})
        self.cap._raw = raw
        self.cap.strings = strings
        self.cap.threads = threads
        if self.plan_recorder is not None:
            self.cap.plans = list(self.plan_recorder.plans)
            self.cap.graphs = list(self.plan_recorder.graphs)
            self.cap.tensors = list(self.plan_recorder.tensors)


def _live_blocks(torch: Any) -> dict[str, list[list[int]]]:
    """(ptr, bytes) of every CUDA caching-allocator block in use (no allocation history needed)."""
    out: dict[str, list[list[int]]] = {}
    try:
        for seg in torch.cuda.memory_snapshot():
            dev = f"cuda:{int(seg.get('device', 0))}"
            for block in seg.get("blocks", []):
                if block.get("state") == "active_allocated":
                    out.setdefault(dev, []).append([int(block["address"]), int(block["size"])])
    except Exception:  # an allocator backend without snapshots: bytes stay "before the capture"
        return {}
    return out


def _at_exit() -> None:
    """Interpreter exit with a capture still open (a `capture()` entered and never left): stop it
    with a warning line instead of a traceback, then stop every hook for good."""
    if _active is not None and _active.meta.get("pid") == os.getpid():  # not a forked child's copy
        print("memprof: warning: a capture was still open at interpreter exit; it was stopped there "
              "(nothing is saved unless the script saves it)", file=sys.stderr)
        with contextlib.suppress(Exception):
            _stop_active()
    native().shutdown()


def _stop_active() -> None:
    global _active
    with _lock:
        rec, _active = _active, None
    if rec is not None:
        rec.stop()


@contextlib.contextmanager
def capture(
    *,
    max_events: int = DEFAULT_MAX_EVENTS,
    scopes: str = "ops",
    kernels: bool = True,
    plans: bool = True,
    meta: dict[str, Any] | None = None,
    knapsack_evaluator: bool = False,
) -> Iterator[Capture]:
    """Capture every allocation and free (CPU and CUDA) on this thread and its autograd threads.

    `scopes` picks the RecordFunction scopes recorded: "ops" (every aten op, autograd node and,
    with `kernels`, each Triton kernel launch), "graphs" (compiled-graph calls and user
    record_function regions; lowest overhead with scopes) or "none". `kernels` makes Inductor
    open a scope for each compiled graph call and kernel launch. `plans` records what
    torch.compile decides for graphs compiled inside the block (partitions, wrapper code;
    Inductor's caches are off meanwhile) for `Capture.attribution`; `knapsack_evaluator` also runs
    the partitioner's in-tree KnapsackEvaluator on each knapsack plan (about 1 s per compiled pair
    on the paper Llama; `memprof sweep` asks for it). The yielded `Capture` is
    filled when the block exits, also when it exits by an exception.
    """
    global _active
    if scopes not in SCOPE_BITS:
        raise MemprofError(f"scopes must be one of {sorted(SCOPE_BITS)}, got {scopes!r}")
    if max_events <= 0:
        raise MemprofError(f"max_events must be positive, got {max_events}")
    cap = Capture(meta=dict(meta or {}))
    rec = _Recorder(cap, max_events, scopes, kernels, plans, knapsack_evaluator)
    with _lock:
        if _active is not None:
            raise MemprofError("a memprof capture is already active in this process")
        rec.start()
        _active = rec
    try:
        yield cap
    finally:
        if _active is rec:
            _stop_active()


def step() -> int:
    """Mark the end of a training step in the active capture; returns the step number (0 if none).

    Once a script calls `memprof.step()`, optimizer steps no longer add markers of their own.
    """
    rec = _active
    if rec is None:
        return 0
    rec.explicit_steps = True
    return rec.mark_step(source="memprof.step")


def active() -> bool:
    """Whether a capture is running in this process."""
    return _active is not None
