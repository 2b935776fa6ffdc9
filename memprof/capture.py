"""The capture result: `Capture` (events, strings, threads, plans, known tensors and the typed
`CaptureInfo` of its metadata) and `load`. Recording lives in `memprof.recorder`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memprof import fileformat
from memprof._events import KIND_NAMES, SEGMENT_KINDS, Kind, device_name
from memprof.analysis.scopes import ScopeIndex
from memprof.analysis.timeline import (
    StepStat,
    Timeline,
    build_timeline,
    gc_freed_positions,
    step_stats,
)
from memprof.capture_info import CaptureInfo
from memprof.errors import IncompleteCaptureError, MemprofError
from memprof.plans import CompiledGraph, KnownTensor, Plan


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
        tensors: list[KnownTensor] | None = None,
    ) -> None:
        self._raw = raw
        self.plans: list[Plan] = plans if plans is not None else []
        """One entry per compiled forward/backward pair (budget, saved, recomputed, random ops)."""
        self.graphs: list[CompiledGraph] = graphs if graphs is not None else []
        """The graphs Inductor compiled during the capture, with their wrapper code."""
        self.tensors: list[KnownTensor] = tensors if tensors is not None else []
        """Known tensors: parameters, gradients and optimizer state, by pointer and time."""
        self._labels: dict[str, Any] = {}
        self.strings: list[str] = strings if strings is not None else [""]
        self.meta: dict[str, Any] = meta if meta is not None else {}
        self.threads: list[dict[str, Any]] = threads if threads is not None else []
        self._timelines: dict[str, Timeline] = {}
        self._events: np.ndarray | None = None
        self._info: CaptureInfo | None = None
        self._scopes: ScopeIndex | None = None
        self.saved_to: Path | None = None
        """Where `capture(output=...)` wrote this capture (None: not written by it)."""

    def set_recorded(self, raw: np.ndarray, strings: list[str], meta: dict[str, Any], threads: list[dict[str, Any]],
                     plans: list[Plan], graphs: list[CompiledGraph], tensors: list[KnownTensor]) -> None:
        """Fill a capture that was recording (the recorder calls this once, when it stops);
        metadata already set on the capture wins over the recorder's."""
        if self._raw is not None:
            raise MemprofError("this capture is already filled")
        self.meta.update({**meta, **self.meta})
        self.strings, self.threads = strings, threads
        self.plans, self.graphs, self.tensors = plans, graphs, tensors
        self._raw = raw
        self._info = None

    def note_outcome(self, status: str, exit_code: int | None, error: str | None) -> None:
        """How the recorded block ended, unless the caller already said (`memprof trace` records
        the script's own status and exit code)."""
        for key, value in (("status", status), ("exit_code", exit_code), ("error", error)):
            self.meta.setdefault(key, value)
        self._info = None

    # -- data ---------------------------------------------------------------------------
    @property
    def info(self) -> CaptureInfo:
        """The metadata the analysis uses, typed (read from `meta` once the capture is filled)."""
        if self._info is None:
            if self._raw is None:
                return CaptureInfo.from_meta(self.meta)
            self._info = CaptureInfo.from_meta(self.meta)
        return self._info

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
        """Devices in use: with allocations, segments, an OOM or bytes at the start; CPU first."""
        raw = self.raw
        mem = np.isin(raw["kind"], [Kind.ALLOC, Kind.FREE, Kind.CUDA_ALLOC, Kind.CUDA_FREE_REQUESTED, Kind.OOM,
                                    *SEGMENT_KINDS])
        pairs = {(int(t), int(i)) for t, i in zip(raw["device_type"][mem], raw["device_index"][mem], strict=True)}
        # the CUDA tracker, attached once CUDA initializes, adds an empty baseline for every GPU: a GPU
        # that CUDA initialized on and nothing was allocated on (a CPU model on a GPU machine) is not in use
        names = {device_name(t, i) for t, i in pairs} | {
            d for d, (allocated, reserved) in self.info.baselines.items() if allocated or reserved or d == "cpu"}
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
        return self.info.dropped_events

    @property
    def exact(self) -> bool:
        """Whether the capture's peak is the script's exact peak: no event was dropped and the capture
        was not stopped before the script ended (by torch.profiler starting)."""
        info = self.info
        return not info.dropped_events and not info.stopped_by and not info.recovered_from

    @property
    def caveats(self) -> list[str]:
        """What limits the capture's figures, one line each, most important first (empty: none).

        Reporters print these next to the headline figures, not at the bottom."""
        info, out = self.info, []
        t0 = info.t_start_ns
        if info.dropped_events:
            when = f" from {(info.first_dropped_ns - t0) / 1e9:.2f} s on" if info.first_dropped_ns is not None else ""
            kept = int((self.raw["kind"] == Kind.STEP).sum()) if info.steps else 0
            of_steps = f"; {kept} of the {info.steps} steps were captured whole" if info.steps else ""
            out.append(f"INCOMPLETE: {info.dropped_events:,} events were dropped{when} (max_events="
                       f"{info.max_events:,}){of_steps}: every peak is a lower bound; raise --max-events")
        if info.recovered_from:
            out.append(f"INCOMPLETE: the run was cut short before memprof could save it (killed, os._exit or a "
                       f"crash); recovered from its spill {info.recovered_from}, which holds the events up to "
                       f"{(info.t_stop_ns - t0) / 1e9:.2f} s (at most the last half second before the end is lost): "
                       "every peak is a lower bound")
        if info.stopped_by:
            at = f" at {(info.t_stop_ns - t0) / 1e9:.2f} s" if info.t_stop_ns else ""
            out.append(f"INCOMPLETE: the capture stopped{at} when the script started {info.stopped_by} "
                       "(they share PyTorch's profiler slot): later allocations are not captured, so the "
                       "peak is the peak up to there")
        if info.window is not None or info.keep_last:
            from memprof.analysis.window import window_caveats

            out.extend(window_caveats(info, self.raw))
        if info.cpu_threads is not None and info.cpu_threads != "all":
            out.append(f"cpu: only the capturing thread and its autograd threads were seen ({info.cpu_threads}); "
                       "allocations and frees on other threads are missing")
        if info.dataloader_workers:
            out.append(f"{info.dataloader_workers} DataLoader worker process(es) ran (num_workers > 0): what they "
                       "allocate is in other processes, and the batches they hand over arrive in shared memory, "
                       "which no PyTorch allocator reports; neither is captured")
        limits = info.recompile_limits
        if limits:
            out.append(f"Dynamo hit {limits[0][:200]}: later calls of that code ran eagerly, not compiled, "
                       "so their memory is the eager run's" + (f" ({len(limits)} such frames)" if len(limits) > 1
                                                               else ""))
        if info.child_processes:
            out.append(f"{info.child_processes} other child process(es) started with multiprocessing: their "
                       "allocations are not captured")
        return out

    @property
    def scopes(self) -> ScopeIndex:
        """The scope begin/end events, paired per thread (`memprof.analysis.scopes`)."""
        if self._scopes is None:
            self._scopes = ScopeIndex(self.raw)
        return self._scopes

    def scope_name(self, scope_id: int) -> str:
        return self.strings[scope_id] if 0 <= scope_id < len(self.strings) else f"<scope {scope_id}>"

    # -- analysis -----------------------------------------------------------------------
    def timeline(self, device: str | None = None) -> Timeline:
        """Live bytes (and reserved bytes, on CUDA) after every event on one device."""
        device = device or self.main_device
        if device not in self._timelines:
            info = self.info
            allocated, reserved = info.baselines.get(device, (0, 0))
            self._timelines[device] = build_timeline(self.raw, device, allocated, reserved,
                                                     device != "cpu" and info.reserved_tracked)
        return self._timelines[device]

    def _check_exact(self, what: str) -> None:
        if self.dropped:
            raise IncompleteCaptureError(
                f"{what}: the capture dropped {self.dropped:,} events after max_events="
                f"{self.info.max_events:,}, so its peak is only a lower bound; pass "
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
        info = self.info
        if tail is None:
            tail = info.status not in (None, "completed", "exit") or not self.exact
        return step_stats(self.raw, self.timeline(device), info.t_start_ns, info.t_stop_ns, tail)

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
        """Category, FX node, layer and kernel of every allocation on a device (memprof.analysis.attribution)."""
        from memprof.analysis.attribution import label_timeline

        device = device or self.main_device
        if device not in self._labels:
            info, raw = self.info, self.raw
            until = int(raw["t_ns"].max()) if info.window_state == "closed" and len(raw) else None
            self._labels[device] = label_timeline(raw, self.strings, self.timeline(device), self.plans,
                                                  self.graphs, self.tensors, info.main_thread,
                                                  info.preexisting.get(device, []), self.scopes, until)
        return self._labels[device]

    def attribution(self, at: str = "peak", by: str = "category", device: str | None = None, *,
                    lower_bound: bool = False) -> list[Any]:
        """What is live at a point, grouped: rows with key, bytes, count, share (and category).

        `at` is "peak" or "step:N" (the peak within step N, as `steps()` finds it); `by` is
        "category", "node", "layer" or "kernel". The rows sum exactly to the live bytes at that point.
        At "peak", a capture that dropped events raises IncompleteCaptureError unless `lower_bound`
        (the peak of the events kept, not the script's).
        """
        from memprof.analysis.attribution import BY, point_of, rows_at

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
        stack = self.scopes.stack_at(int(tl.rows[tl.peak_pos]), self.info.main_thread)
        return [self.scope_name(s) for s in stack]

    # -- files --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the capture to a .memprof file (atomically); returns the path."""
        parts = fileformat.Parts(self.raw, self.strings, self.meta, self.threads, self.plans, self.graphs,
                                 self.tensors)
        return fileformat.save(parts, Path(path))

    def __repr__(self) -> str:
        if self.recording:
            return "<memprof.Capture (recording)>"
        return f"<memprof.Capture {len(self.raw)} events, devices {self.devices}>"


def load(path: str | os.PathLike[str]) -> Capture:
    """Read a .memprof file written by `Capture.save` or `memprof trace` (`fileformat.read` checks
    every member first: a truncated, corrupt or hostile file is one CaptureFileError line). When
    the file is missing but the spill of a run that was cut short is beside it (or `path` is the
    spill), the capture is recovered from the spill (`memprof.spill`)."""
    from memprof import spill

    p = Path(path)
    left = spill.spill_path(p)
    if p.suffix == ".spill" and p.is_file():
        parts = spill.read(p)
    elif not p.exists() and left.is_file():
        parts = spill.read(left)
    else:
        parts = fileformat.read(p)
    raw, strings, meta, threads, plans, graphs, tensors = parts
    return Capture(raw=raw, strings=strings, meta=meta, threads=threads, plans=plans, graphs=graphs, tensors=tensors)
