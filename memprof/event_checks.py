"""The checks a stored event array passes before memprof reads it (`memprof.fileformat.read`, and a
spill's recovery): kinds it knows, devices it names, sizes of real memory with the sign of their kind,
times in range and in order. A hostile or corrupt array is one CaptureFileError line."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from memprof._events import EVENT_DTYPE, FLAG_CARRIED, SEGMENT_KINDS, Events, Kind, kind_mask
from memprof.capture_info import MAX_BLOCK_BYTES, MAX_TIME_NS, MAX_TOTAL_BYTES
from memprof.errors import CaptureFileError

_EVENT_KINDS = {k.value for k in Kind}
# events whose bytes are memory (allocations, frees, segments, OOM requests)
_SIZED_KINDS = (Kind.ALLOC, Kind.FREE, Kind.CUDA_ALLOC, Kind.CUDA_FREE_REQUESTED, Kind.CUDA_FREE_COMPLETED,
                *SEGMENT_KINDS, Kind.OOM)
# The sign an event's bytes must have, by kind: + allocations and segments made, - frees and segments
# given back; OOM requests and step numbers are >= 0.
_POSITIVE = (Kind.ALLOC, Kind.CUDA_ALLOC, Kind.SEGMENT_ALLOC, Kind.SEGMENT_MAP)
_NEGATIVE = (Kind.FREE, Kind.CUDA_FREE_REQUESTED, Kind.CUDA_FREE_COMPLETED, Kind.SEGMENT_FREE, Kind.SEGMENT_UNMAP)
# Events are stored in the order they were appended; each took its time just before, so threads can
# swap a little (a thread descheduled between the two): more than this backwards, or steps back at
# more than a few of them, is no real capture.
_MAX_BACKWARDS_NS = 10_000_000_000
_MAX_BACK_STEPS = 0.05


def meminfo(key: str) -> int | None:
    """A figure of Linux's /proc/meminfo in bytes ("MemAvailable", "MemTotal"), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (Linux's MemAvailable), or None where unknown."""
    return meminfo("MemAvailable")


def check_fits(n: int, path: Path, what: str = "capture") -> None:
    """Refuse in one line to read `n` events that the machine's available memory cannot hold (the
    analysis needs them in memory, and a page-by-page read would end in the OOM killer, not a message)."""
    need, free = n * EVENT_DTYPE.itemsize, available_memory()
    if free is not None and need > free:
        raise CaptureFileError(f"{path}: the {what} holds {n:,} events ({need / 1e9:.1f} GB in memory) and this "
                               f"machine has {free / 1e9:.1f} GB available: read it on a machine with more memory, "
                               "or record fewer steps (memprof trace --steps A:B or --keep-last N)")


_CHECK_CHUNK = 1 << 20  # events checked at a time: the checks' temporaries stay a few tens of MB


def check_events(raw: Events, strings: list[str], path: Path) -> None:
    """Event fields in the ranges memprof writes, and the stream's invariants: kinds it knows, devices
    it names, sizes of real memory with the sign of their kind, times in range and in order (the
    blocks carried into a window or a ring lead, with their earlier times). Checked a chunk of events
    at a time, in time linear in the events and memory bounded by the chunk."""
    if not len(raw):
        return
    total = 0.0
    for start in range(0, len(raw), _CHECK_CHUNK):
        total = _check_values(raw, start, total, path)
    carried = (raw["flags"] & FLAG_CARRIED) != 0
    lead = int(np.argmin(carried)) if not carried.all() else len(raw)
    if carried[lead:].any():
        i = lead + int(np.argmax(carried[lead:]))
        raise CaptureFileError(f"{path}: corrupt capture (event {i}: a carried event after the stored steps began)")
    del carried
    _check_order(raw["t_ns"], lead, path)
    if int(raw["scope"].max()) >= len(strings):
        raise CaptureFileError(f"{path}: corrupt capture (scope ids outside the string table)")


def _check_values(raw: Events, start: int, total: float, path: Path) -> float:
    """`check_events` on the events from `start` on (one chunk); returns the sizes added up so far."""
    chunk = raw[start : start + _CHECK_CHUNK]

    def refuse(bad: np.ndarray, what: str) -> None:
        if bad.any():
            i = start + int(np.argmax(bad))
            fields = {k: int(raw[k][i]) for k in ("kind", "bytes", "t_ns", "device_type")}
            raise CaptureFileError(f"{path}: corrupt capture (event {i}: {what.format(**fields)})")

    kinds = chunk["kind"]
    refuse(~kind_mask(kinds, _EVENT_KINDS), "unknown kind {kind}")
    memory = kind_mask(kinds, _SIZED_KINDS)
    device_type = chunk["device_type"]
    refuse(memory & (device_type != 0) & (device_type != 1), "device type {device_type} is neither cpu nor cuda")
    size = np.abs(chunk["bytes"].astype(np.float64))
    refuse(memory & (size > MAX_BLOCK_BYTES), "{bytes:,} bytes is not a real allocation")
    total += float(size[memory].sum())
    if total > MAX_TOTAL_BYTES:
        raise CaptureFileError(f"{path}: corrupt capture (event sizes add up past what 64-bit counts hold)")
    nbytes = chunk["bytes"]
    refuse(kind_mask(kinds, _POSITIVE) & (nbytes <= 0), "an allocation of {bytes:,} bytes (allocations are positive)")
    refuse(kind_mask(kinds, _NEGATIVE) & (nbytes >= 0), "a free of {bytes:,} bytes (frees are negative)")
    refuse(((kinds == Kind.OOM) | (kinds == Kind.STEP)) & (nbytes < 0), "a negative count {bytes:,}")
    t = chunk["t_ns"]
    refuse((t < 0) | (t >= MAX_TIME_NS), "time {t_ns} ns is outside the steady clock's range")
    return total


def _check_order(t: np.ndarray, lead: int, path: Path) -> None:
    """The stored steps' events (from `lead` on) in time order, give or take what threads swap; the
    carried ones before them. A chunk at a time, with the running maximum carried across."""
    n = len(t) - lead
    if n <= 0:
        return
    steps_back, top = 0, int(t[lead])
    for at in range(lead, len(t), _CHECK_CHUNK):
        own = t[at : at + _CHECK_CHUNK + 1]  # (one past: the step back across the chunks' border)
        steps_back += int((own[1:] < own[:-1]).sum())
        back = np.maximum(np.maximum.accumulate(own), top) - own
        if int(back.max()) > _MAX_BACKWARDS_NS:
            i = at + int(np.argmax(back > _MAX_BACKWARDS_NS))
            raise CaptureFileError(f"{path}: corrupt capture (event {i}: its time is {int(back[i - at]) / 1e9:.1f} s "
                                   "before an earlier event's: events are stored in time order)")
        top = max(top, int(own.max()))
    if steps_back > max(16, _MAX_BACK_STEPS * n):
        raise CaptureFileError(f"{path}: corrupt capture ({steps_back:,} of its {n:,} events are before "
                               "an earlier event's time: events are stored in time order)")
    if lead and int(t[:lead].max()) > int(t[lead]) + _MAX_BACKWARDS_NS:
        raise CaptureFileError(f"{path}: corrupt capture (a carried event is later than the stored steps)")


