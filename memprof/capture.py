"""The capture result: `Capture` (events, strings, threads, plans, known tensors and the typed
`CaptureInfo` of its metadata) and `load`. Recording lives in `memprof.recorder`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memprof import fileformat
from memprof._events import KIND_NAMES, SEGMENT_KINDS, CarriedBlock, Events, Kind, device_name, kind_mask
from memprof.analysis.attribution import AttributionRow, label_timeline
from memprof.analysis.garbage import gc_freed_positions
from memprof.analysis.labels import Labels
from memprof.analysis.scopes import ScopeIndex
from memprof.analysis.timeline import StepStat, Timeline, build_timeline, step_stats
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
        raw: np.ndarray | Events | None = None,
        strings: list[str] | None = None,
        meta: dict[str, Any] | None = None,
        threads: list[dict[str, Any]] | None = None,
        plans: list[Plan] | None = None,
        graphs: list[CompiledGraph] | None = None,
        tensors: list[KnownTensor] | None = None,
        carried: list[CarriedBlock] | None = None,
    ) -> None:
        self._raw = None if raw is None else Events.of(raw)
        self._source: fileformat.EventSource | None = None  # the events, not read yet (`set_recorded`)
        self.plans: list[Plan] = plans if plans is not None else []
        """One entry per compiled forward/backward pair (budget, saved, recomputed, random ops)."""
        self.graphs: list[CompiledGraph] = graphs if graphs is not None else []
        """The graphs Inductor compiled during the capture, with their wrapper code."""
        self.tensors: list[KnownTensor] = tensors if tensors is not None else []
        """Known tensors: parameters, gradients and optimizer state, by pointer and time."""
        self.carried: list[CarriedBlock] = carried if carried is not None else []
        """Where each block carried into a step window or a ring was allocated (its scopes)."""
        self._labels: dict[str, Labels] = {}
        self._gc_freed: dict[str, np.ndarray] = {}
        self.strings: list[str] = strings if strings is not None else [""]
        self.meta: dict[str, Any] = meta if meta is not None else {}
        self.threads: list[dict[str, Any]] = threads if threads is not None else []
        self._timelines: dict[str, Timeline] = {}
        self._events: np.ndarray | None = None
        self._info: CaptureInfo | None = None
        self._scopes: ScopeIndex | None = None
        self._devices: list[str] | None = None  # (the events never change once filled)
        self.saved_to: Path | None = None
        """Where `capture(output=...)` wrote this capture (None: not written by it)."""

    def set_recorded(self, raw: np.ndarray | fileformat.EventSource, strings: list[str], meta: dict[str, Any],
                     threads: list[dict[str, Any]],
                     plans: list[Plan], graphs: list[CompiledGraph], tensors: list[KnownTensor],
                     carried: list[CarriedBlock] | None = None) -> None:
        """Fill a capture that was recording (the recorder calls this once, when it stops);
        metadata already set on the capture wins over the recorder's."""
        if not self.recording:
            raise MemprofError("this capture is already filled")
        self.meta.update({**meta, **self.meta})
        self.strings, self.threads = strings, threads
        self.plans, self.graphs, self.tensors = plans, graphs, tensors
        self.carried = list(carried or [])
        if isinstance(raw, np.ndarray):
            self._raw = Events.of(raw)
        else:  # (a spill's events: saved from where they lie, read into memory at the first use)
            self._source = raw
        self._info = None

    def note_outcome(self, status: str, exit_code: int | None, error: str | None) -> None:
        """How the recorded block ended, unless the caller already said (`memprof trace` records
        the script's own status and exit code)."""
        for key, value in (("status", status), ("exit_code", exit_code), ("error", error)):
            self.meta.setdefault(key, value)
        self._info = None

    def refresh_info(self) -> None:
        """Read `meta` again for `info` (after a caller added to it)."""
        self._info = None

    # -- data ---------------------------------------------------------------------------
    @property
    def info(self) -> CaptureInfo:
        """The metadata the analysis uses, typed (read from `meta` once the capture is filled)."""
        if self._info is None:
            if self.recording:
                return CaptureInfo.from_meta(self.meta)
            self._info = CaptureInfo.from_meta(self.meta)
        return self._info

    @property
    def raw(self) -> Events:
        """The events as stored, in columns (`raw["kind"]`, ...; `scope` indexes `strings`)."""
        if self._raw is None and self._source is not None:
            self._raw, self._source = self._source.read(), None
        if self._raw is None:
            raise MemprofError("the capture is still running; its events are available after it stops")
        return self._raw

    @property
    def recording(self) -> bool:
        return self._raw is None and self._source is None

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
        if self._devices is not None:
            return list(self._devices)
        raw = self.raw
        dtype_col, index_col = raw["device_type"], raw["device_index"]
        mem = kind_mask(raw["kind"], [Kind.ALLOC, Kind.FREE, Kind.CUDA_ALLOC, Kind.CUDA_FREE_REQUESTED, Kind.OOM,
                                      *SEGMENT_KINDS])
        first = int(np.argmax(mem)) if mem.any() else -1
        if first >= 0 and index_col.strides == (0,) and not (mem & (dtype_col != dtype_col[first])).any():
            codes = np.asarray([int(dtype_col[first]) * 256 + int(index_col[first])])  # (a CPU capture: no gathers)
        else:  # (most captures are of one device: a min and a max where a sort of millions took 0.1 s)
            codes = dtype_col[mem].astype(np.int32) * 256 + index_col[mem].astype(np.int32)
            codes = codes[:1] if len(codes) and codes.min() == codes.max() else np.unique(codes)
        pairs = {((int(c) + 128) // 256, int(c) - (int(c) + 128) // 256 * 256) for c in codes.tolist()}
        # the CUDA tracker, attached once CUDA initializes, adds an empty baseline for every GPU: a GPU
        # that CUDA initialized on and nothing was allocated on (a CPU model on a GPU machine) is not in use
        names = {device_name(t, i) for t, i in pairs} | {
            d for d, (allocated, reserved) in self.info.baselines.items() if allocated or reserved or d == "cpu"}
        self._devices = sorted(names, key=lambda d: (d != "cpu", d))
        return list(self._devices)

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
        """Whether the capture's peak is the script's exact peak: no event was dropped, the capture
        was not stopped before the script ended (by torch.profiler starting) and its events are
        consistent (`problems`)."""
        info = self.info
        return not info.dropped_events and not info.stopped_by and not info.recovered_from and not self.problems

    @property
    def t0_ns(self) -> int:
        """Time zero of the capture's reports (steady-clock ns): when it started, else its first event."""
        return self.info.t_start_ns or (int(self.raw["t_ns"][0]) if len(self.raw) else 0)

    @property
    def problems(self) -> list[str]:
        """What in the events no real capture holds, per device ("cpu: ..."; `timeline.consistency`)."""
        return [f"{d}: {p}" for d in self.devices for p in self.timeline(d).problems]

    @property
    def caveats(self) -> list[str]:
        """What limits the capture's figures, one line each, most important first (empty: none).

        Reporters print these next to the headline figures, not at the bottom."""
        from memprof.analysis.caveats import capture_caveats

        return capture_caveats(self.info, self.raw, self.problems, self.meta.get("budget"))

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
                                                     device != "cpu" and info.reserved_tracked,
                                                     unseen_frees=not info.first_in_process,
                                                     every_thread=device != "cpu" or info.cpu_threads in (None, "all"))
        return self._timelines[device]

    def _check_exact(self, what: str) -> None:
        if self.problems:
            raise IncompleteCaptureError(f"{what}: the capture's events are inconsistent ({'; '.join(self.problems)})")
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
        if tail is None:  # (after a window closed, the events are the frees of its blocks: no step)
            tail = info.window_state != "closed" and (info.status not in (None, "completed", "exit") or not self.exact)
        return step_stats(self.raw, self.timeline(device), info.t_start_ns, info.t_stop_ns, tail)

    def live_at(self, device: str | None = None, pos: int | None = None, top: int | None = None
                ) -> list[LiveAllocation]:
        """Captured allocations live just after timeline position `pos` (default: the peak), largest first
        (`top`: only the largest so many)."""
        tl = self.timeline(device)
        if pos is None:
            pos = tl.peak_pos
        raw = self.raw
        live = tl.live_positions(pos) if pos >= 0 else np.zeros(0, np.int64)
        sizes = tl.delta_at(live)
        order = np.argsort(-sizes, kind="stable")[:top]
        rows = tl.rows[live[order]]
        kinds, aux = raw["kind"][rows], raw["aux"][rows]
        return [
            LiveAllocation(
                ptr=int(raw["ptr"][r]), bytes=int(sizes[i]), t_ns=int(raw["t_ns"][r]),
                scope=self.scope_name(int(raw["scope"][r])), thread=int(raw["thread"][r]),
                requested=int(aux[j]) if kinds[j] == Kind.ALLOC else -1, stream=int(raw["stream"][r]), row=int(r),
            )
            for j, (i, r) in enumerate(zip(order.tolist(), rows.tolist(), strict=True))
        ]

    def gc_freed(self, device: str | None = None) -> np.ndarray:
        """Timeline positions (`timeline(device)`) of the frees Python's cyclic garbage collector made
        during the capture: tensors that lived in reference cycles (`garbage.gc_freed_positions`)."""
        device = device or self.main_device
        if device not in self._gc_freed:
            freed = gc_freed_positions(self.raw, self.timeline(device), self.strings)
            freed.setflags(write=False)
            self._gc_freed[device] = freed
        return self._gc_freed[device]

    def live_at_peak(self, device: str | None = None) -> list[LiveAllocation]:
        """The live set at the device's peak: each live allocation with bytes, time and scope."""
        return self.live_at(device, None)

    def labels(self, device: str | None = None) -> Labels:
        """Category, FX node, layer and kernel of every allocation on a device (memprof.analysis.attribution)."""
        device = device or self.main_device
        if device not in self._labels:
            info, raw = self.info, self.raw
            markers = np.flatnonzero(raw["kind"] == Kind.STEP)
            closed = info.window_state == "closed" and len(markers)
            until = int(raw["t_ns"][markers[-1]]) if closed else None
            self._labels[device] = label_timeline(raw, self.strings, self.timeline(device), self.plans, self.graphs,
                                                  self.tensors, info.main_thread, info.preexisting.get(device, []),
                                                  self.scopes, until, self.carried,
                                                  int(markers[-1]) if closed else None, self.gc_freed(device))
        return self._labels[device]

    def attribution(self, at: str = "peak", by: str = "category", device: str | None = None, *,
                    lower_bound: bool = False) -> list[AttributionRow]:
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
    def save(self, path: str | os.PathLike[str], overwrite: bool = True) -> Path:
        """Write the capture to a .memprof file (atomically); returns the path. Without `overwrite`, an
        existing file is kept (FileExistsError)."""
        events = self._source if self._raw is None and self._source is not None else self.raw
        parts = fileformat.Parts(events, self.strings, self.meta, self.threads, self.plans, self.graphs,
                                 self.tensors, self.carried)
        return fileformat.save(parts, Path(path), overwrite)

    def __repr__(self) -> str:
        if self.recording:
            return "<memprof.Capture (recording)>"
        return f"<memprof.Capture {len(self.raw)} events, devices {self.devices}>"


def load(path: str | os.PathLike[str]) -> Capture:
    """Read a .memprof file written by `Capture.save` or `memprof trace` (`fileformat.read` checks
    every member first: a truncated, corrupt or hostile file is one CaptureFileError line). When
    the file is missing but the spill of a run that was cut short is beside it (or `path` is the
    spill), the capture is recovered from the spill (`memprof.spill`). A memory snapshot (the pickle
    `torch.cuda.memory._dump_snapshot` writes) is read as a capture of its trace (`memprof.snapshot`)."""
    from memprof import snapshot, spill, spill_read

    p = Path(path)
    left = spill.spill_path(p)
    if p.is_file() and snapshot.is_pickle(p):  # a memory_viz snapshot (`_dump_snapshot`), read as plain data
        parts = snapshot.load(p)
    elif p.suffix == ".spill" and p.is_file():
        parts = spill_read.read(p)
    elif not p.exists() and left.is_file():
        parts = spill_read.read(left)
    else:
        parts = fileformat.read(p)
    raw = parts.raw if isinstance(parts.raw, Events) else parts.raw.read()
    return Capture(raw=raw, strings=parts.strings, meta=parts.meta, threads=parts.threads, plans=parts.plans,
                   graphs=parts.graphs, tensors=parts.tensors, carried=parts.carried)
