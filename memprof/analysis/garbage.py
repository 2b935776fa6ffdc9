"""Python's cyclic garbage collector in a capture: the frees it made (tensors held in reference
cycles, freed when a collection happens to run rather than at their last reference), and the bytes
they held."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memprof._events import Events
from memprof.analysis.timeline import Timeline, mark_windows

GC_START = "python gc: start"
GC_STOP = "python gc: stop"


def gc_freed_positions(raw: Events, timeline: Timeline, strings: Sequence[str]) -> np.ndarray:
    """Timeline positions of the frees Python's cyclic garbage collector made: frees on the thread
    of a collection, between its start and stop marks (tensors held in reference cycles, freed when
    a collection happens to run rather than when their last reference goes)."""
    windows = mark_windows(raw, strings, GC_START, GC_STOP)
    if not windows or len(timeline.rows) == 0:
        return np.zeros(0, np.int64)
    # The positions between each collection's marks (the timeline's rows are in order), not every free
    # asked which collection holds it: a collection holds a few events, a capture millions of frees.
    arr = np.asarray(windows, dtype=np.int64)
    lo = np.searchsorted(timeline.rows, arr[:, 1], side="right")
    counts = np.maximum(np.searchsorted(timeline.rows, arr[:, 2], side="left") - lo, 0)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    pos = np.arange(total, dtype=np.int64) + np.repeat(lo - (np.cumsum(counts) - counts), counts)
    rows = timeline.rows[pos]
    own = (raw["thread"][rows].astype(np.int64) == np.repeat(arr[:, 0], counts)) & ~timeline.is_alloc[pos]
    return np.sort(pos[own])


def freed_bytes(timeline: Timeline, positions: np.ndarray, start_row: int = 0, end_row: int | None = None) -> int:
    """Bytes freed at the given free positions (e.g. `gc_freed_positions`) whose events lie in
    rows [start_row, end_row)."""
    rows = timeline.rows[positions]
    keep = (rows >= start_row) if end_row is None else (rows >= start_row) & (rows < end_row)
    return int(-timeline.delta_at(positions[keep]).sum())


def garbage_at(timeline: Timeline, pos: int, gc_positions: np.ndarray) -> int:
    """Bytes live just after position `pos` that Python's cyclic garbage collector freed later (their
    frees among `gc_positions`, `gc_freed_positions`): garbage in reference cycles that a collection
    at a fixed point (`gc.collect()`) would have freed before."""
    if pos < 0 or not len(gc_positions):
        return 0
    live = timeline.live_positions(pos)
    held = np.isin(timeline.free_of[live], gc_positions)
    return int(timeline.delta_at(live[held]).sum())
