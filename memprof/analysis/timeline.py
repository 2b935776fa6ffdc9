"""Pure analysis of captured events: per-device timelines, peaks, live sets and steps.

Everything here works on the raw event array (`memprof._events.EVENT_DTYPE`) with numpy;
nothing prints or reads files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from memprof._events import (
    FLAG_UNFOLLOWED_THREAD,
    SEGMENT_KINDS,
    Events,
    Kind,
    index_dtype,
    kind_mask,
    parse_device,
)
from memprof.analysis.units import round_up_array
from memprof.analysis.window import carried_count

_MEMORY_KINDS = np.array([Kind.ALLOC, Kind.FREE, Kind.CUDA_ALLOC, Kind.CUDA_FREE_REQUESTED], dtype=np.uint8)


def device_mask(raw: Events, device: str) -> np.ndarray:
    dtype, dindex = parse_device(device)
    mask = raw["device_type"] == dtype
    if dtype != 0:
        mask &= raw["device_index"] == dindex
    return np.asarray(mask)


@dataclass(frozen=True)
class Timeline:
    """Live bytes on one device after every allocation and free, in capture order.

    `rows` index the capture's event array; `allocated[i]` is the live byte count
    (the baseline included) just after event `rows[i]`. Frees and allocations are
    paired by address: `free_of[i]` is the position of the free of the allocation
    at position i (-1: still live at the end), `alloc_of` the reverse. An event's change in
    live bytes (`delta_at`) and its time (`t_at`) are read from `allocated` and the events'
    time column: the timeline holds no per-event copy of them.
    """

    device: str
    baseline: int
    rows: np.ndarray
    t_col: np.ndarray  # the capture's `t_ns` column (every event's; not a copy)
    allocated: np.ndarray
    is_alloc: np.ndarray
    free_of: np.ndarray
    inferred: int = 0
    has_reserved: bool = False  # segment events were captured (CUDA tracker attached)
    reserved_baseline: int = 0
    reserved_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    reserved_t_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    reserved: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # what in the events no real capture holds (`consistency`): its figures cannot be vouched for
    problems: tuple[str, ...] = ()

    @cached_property
    def alloc_of(self) -> np.ndarray:
        """The position of the allocation each free frees (-1: none captured, and for allocations):
        `free_of` inverted, made when first asked for."""
        out = np.full(len(self.free_of), -1, dtype=self.free_of.dtype)
        freed = np.flatnonzero(self.free_of >= 0)
        out[self.free_of[freed]] = freed
        return out

    def delta_at(self, pos: np.ndarray | int) -> np.ndarray:
        """The change in live bytes at the given positions (an allocation's size, a free's negative;
        the block size where the CUDA tracker's request was rounded up)."""
        pos = np.asarray(pos, dtype=np.int64)
        before = np.where(pos > 0, self.allocated[np.maximum(pos - 1, 0)], self.baseline)
        out: np.ndarray = self.allocated[pos] - before
        return out

    def t_at(self, pos: np.ndarray | int | slice) -> np.ndarray:
        """The time (steady clock, ns) of the events at the given positions."""
        out: np.ndarray = self.t_col[self.rows[pos]]
        return out

    @property
    def delta(self) -> np.ndarray:
        """`delta_at` of every position (a new array each time: for a few positions, `delta_at`)."""
        return np.diff(self.allocated, prepend=self.baseline)

    @property
    def t_ns(self) -> np.ndarray:
        """`t_at` of every position (a new array each time: for a few positions, `t_at`)."""
        return self.t_at(slice(None))

    @property
    def peak(self) -> int:
        """The exact peak of live bytes (the baseline if nothing was allocated)."""
        if len(self.allocated) == 0:
            return self.baseline
        return max(self.baseline, int(self.allocated.max()))

    @property
    def peak_pos(self) -> int:
        """Position of the first event that reached the peak; -1 if the peak is the baseline."""
        if len(self.allocated) == 0 or int(self.allocated.max()) <= self.baseline:
            return -1
        return int(np.argmax(self.allocated))

    @property
    def final(self) -> int:
        return int(self.allocated[-1]) if len(self.allocated) else self.baseline

    def pos_before_row(self, row: int) -> int:
        """Position of the last memory event strictly before event `row` (-1 if none)."""
        return int(np.searchsorted(self.rows, row, side="left")) - 1

    def allocated_at_pos(self, pos: int) -> int:
        return self.baseline if pos < 0 else int(self.allocated[pos])

    def allocated_before_row(self, row: int) -> int:
        """Live bytes just before event `row` happened."""
        return self.allocated_at_pos(self.pos_before_row(row))

    def reserved_before_row(self, row: int) -> int | None:
        """Reserved bytes just before event `row`, when segment events were captured."""
        if not self.has_reserved:
            return None
        pos = int(np.searchsorted(self.reserved_rows, row, side="left")) - 1
        return self.reserved_baseline if pos < 0 else int(self.reserved[pos])

    @property
    def reserved_peak(self) -> int:
        return max([self.reserved_baseline, *([int(self.reserved.max())] if len(self.reserved) else [])])

    def live_positions(self, pos: int) -> np.ndarray:
        """Positions of the captured allocations live just after position `pos`."""
        k = min(pos + 1, len(self.rows))
        free_of = self.free_of[:k]
        return np.flatnonzero(self.is_alloc[:k] & ((free_of < 0) | (free_of > pos)))


def _tracker_sizes(kinds: np.ndarray, delta: np.ndarray, free_of: np.ndarray, alloc_of: np.ndarray) -> int:
    """Events seen only by the CUDA tracker carry requested sizes, not block sizes: take the block size
    from the paired reporter event, else round the request up to the caching allocator's granule (in
    `delta`, in place); returns how many were rounded."""
    inferred = 0
    tracker_alloc = np.flatnonzero(kinds == Kind.CUDA_ALLOC)
    if len(tracker_alloc):
        paired = free_of[tracker_alloc]
        exact = (paired >= 0) & (kinds[np.maximum(paired, 0)] == Kind.FREE)
        delta[tracker_alloc[exact]] = -delta[paired[exact]]
        delta[tracker_alloc[~exact]] = round_up_array(delta[tracker_alloc[~exact]])
        inferred += int((~exact).sum())
    tracker_free = np.flatnonzero(kinds == Kind.CUDA_FREE_REQUESTED)
    if len(tracker_free):
        paired = alloc_of[tracker_free]
        has = paired >= 0
        delta[tracker_free[has]] = -delta[paired[has]]
        delta[tracker_free[~has]] = -round_up_array(delta[tracker_free[~has]])
        inferred += int((~has).sum())
    return inferred


def build_timeline(
    raw: Events,
    device: str,
    baseline: int = 0,
    reserved_baseline: int = 0,
    has_reserved: bool = False,
    unseen_frees: bool = True,
    every_thread: bool = True,
) -> Timeline:
    """The timeline of one device from the raw events. `unseen_frees`: frees of blocks the capture
    never saw allocated can be real (CUDA blocks from before it; CPU blocks an earlier capture in the
    process saw); where they cannot, each is a problem (`consistency`). `every_thread`: every thread's
    allocations and frees were seen (else an address can come back allocated on the one followed)."""
    on_device = device_mask(raw, device)
    idx_t = index_dtype(len(raw))
    rows = np.flatnonzero(on_device & kind_mask(raw["kind"], _MEMORY_KINDS)).astype(idx_t)
    seg_rows = np.flatnonzero(on_device & kind_mask(raw["kind"], SEGMENT_KINDS)).astype(np.int64)
    del on_device
    kinds = raw["kind"][rows]
    is_alloc = (kinds == Kind.ALLOC) | (kinds == Kind.CUDA_ALLOC)

    # Pair each allocation with the next free of the same address.
    n = len(rows)
    free_of = np.full(n, -1, dtype=idx_t)
    alloc_of = np.full(n, -1, dtype=idx_t)
    twice = 0  # allocations at an address still live (no real capture has one: `consistency`)
    if n > 1:
        ptrs = raw["ptr"][rows]
        order = np.argsort(ptrs, kind="stable")  # (by address, then in time)
        ptrs = ptrs[order]
        same = ptrs[1:] == ptrs[:-1]
        del ptrs
        sorted_alloc = is_alloc[order]
        twice = int((same & sorted_alloc[:-1] & sorted_alloc[1:]).sum())
        pair = same & sorted_alloc[:-1] & ~sorted_alloc[1:]
        del same, sorted_alloc
        a_pos, f_pos = order[:-1][pair], order[1:][pair]
        del order, pair
        free_of[a_pos] = f_pos
        alloc_of[f_pos] = a_pos
        del a_pos, f_pos

    # (the sizes only now: the pairing's sort is where building a timeline peaks in memory)
    delta = raw["bytes"][rows].astype(np.int64, copy=False)
    inferred = _tracker_sizes(kinds, delta, free_of, alloc_of)

    if device == "cpu":
        # CPU bytes count from the capture start: a free of a tensor allocated before it (which
        # PyTorch reports when an earlier capture saw the allocation) must not count below zero.
        delta[~is_alloc & (alloc_of < 0)] = 0
    allocated = np.cumsum(delta)
    del delta
    allocated += baseline
    problems = consistency(raw, rows, kinds, is_alloc, free_of, alloc_of, allocated,
                           unseen_frees or device != "cpu" or not every_thread, twice if every_thread else 0)
    reserved = reserved_baseline + np.cumsum(raw["bytes"][seg_rows].astype(np.int64))
    return Timeline(
        device=device,
        baseline=int(baseline),
        rows=rows,
        t_col=raw["t_ns"],
        allocated=allocated,
        is_alloc=is_alloc,
        free_of=free_of,
        inferred=inferred,
        has_reserved=has_reserved,
        reserved_baseline=int(reserved_baseline),
        reserved_rows=seg_rows,
        reserved_t_ns=raw["t_ns"][seg_rows].astype(np.int64),
        reserved=np.asarray(reserved, dtype=np.int64),
        problems=problems,
    )


def consistency(raw: Events, rows: np.ndarray, kinds: np.ndarray, is_alloc: np.ndarray, free_of: np.ndarray,
                alloc_of: np.ndarray, allocated: np.ndarray, unseen_frees: bool, twice: int) -> tuple[str, ...]:
    """What in one device's allocations and frees no real capture holds: an address allocated again
    before it was freed (`twice`, counted where the timeline pairs them), a free of another size than
    its allocation, a free of an address the capture never allocated (where that cannot be real),
    fewer bytes live than none."""
    out: list[str] = []
    if twice:
        out.append(f"{twice:,} blocks allocated again at an address still live")
    reporter = np.flatnonzero(is_alloc & (kinds == Kind.ALLOC) & (free_of >= 0))
    paired = free_of[reporter]
    sizes_differ = reporter[(kinds[paired] == Kind.FREE)
                            & (raw["bytes"][rows[paired]] != -raw["bytes"][rows[reporter]])]
    if len(sizes_differ):
        out.append(f"{len(sizes_differ):,} frees of another size than their allocation")
    unseen = int((~is_alloc & (alloc_of < 0)).sum())
    if unseen and not unseen_frees:
        out.append(f"{unseen:,} frees of addresses the capture never allocated")
    if len(allocated) and int(allocated.min()) < 0:
        out.append("more bytes freed than were live")
    return tuple(out)


def unfollowed_count(raw: Events) -> int:
    """Allocator events memprof saw only through the CUDA tracker (threads it does not follow)."""
    return int(((raw["flags"] & FLAG_UNFOLLOWED_THREAD) != 0).sum())


def window_peak(timeline: Timeline, start_row: int, end_row: int) -> tuple[int, int]:
    """The most live bytes over the events in rows [start_row, end_row), the level at its start
    included, and the timeline position where it is reached: the position just before the window
    when the starting level is the highest (-1: the baseline). The one definition of a step's peak
    (`step_stats`, `attribution.point_of`, `sweep.measure`)."""
    p0 = timeline.pos_before_row(start_row)
    p1 = timeline.pos_before_row(end_row)
    level = timeline.allocated_at_pos(p0)
    inside = timeline.allocated[p0 + 1 : p1 + 1]
    if len(inside) and int(inside.max()) > level:
        return int(inside.max()), p0 + 1 + int(np.argmax(inside))
    return level, p0


def window_rise(timeline: Timeline, start_row: int, end_row: int) -> tuple[int, int]:
    """The most live bytes over the events in rows [start_row, end_row) above the lowest level
    reached before them in the window (its starting level included), and the timeline position of
    that high point (-1 or the position just before the window: no rise). A step that first frees
    what the last one left (`zero_grad(set_to_none=True)`: its gradients) is measured above what is
    resident while it runs, not above its start; with nothing freed first, this is `window_peak`
    less the starting level."""
    p0 = timeline.pos_before_row(start_row)
    levels = _levels(timeline, p0, timeline.pos_before_row(end_row))
    rises = levels - np.minimum.accumulate(levels)
    at = int(np.argmax(rises))
    return int(rises[at]), p0 + at


def rise_start(timeline: Timeline, start_row: int, high_pos: int) -> int:
    """The timeline position a `window_rise` is measured from: the last time the live bytes were at
    their lowest between the window's start (`start_row`) and its high point (`high_pos`); the
    position just before the window when that is the lowest."""
    p0 = timeline.pos_before_row(start_row)
    if high_pos <= p0:
        return p0
    levels = _levels(timeline, p0, high_pos)
    return p0 + int(len(levels) - 1 - np.argmin(levels[::-1]))


def _levels(timeline: Timeline, p0: int, p1: int) -> np.ndarray:
    """The live bytes at position `p0` (before a window: its starting level) and after each event to `p1`."""
    return np.concatenate(([timeline.allocated_at_pos(p0)], timeline.allocated[p0 + 1 : p1 + 1]))


@dataclass(frozen=True)
class StepStat:
    """One training step: the events between two step markers."""

    step: int
    start_row: int  # first event row of the step
    end_row: int  # the marker row that ends the step (exclusive), or len(events)
    t_start_ns: int
    t_end_ns: int
    peak: int
    allocated_at_end: int
    reserved_at_end: int | None
    complete: bool
    peak_pos: int = -1  # timeline position of the peak (`window_peak`)


def step_stats(raw: Events, timeline: Timeline, t_start_ns: int, t_stop_ns: int,
               tail: bool = True) -> list[StepStat]:
    """Per-step peaks: step k spans from marker k-1 (or the capture start) to marker k.

    Events after the last marker form an incomplete final step when `tail` is set (a step the
    capture stopped in) or when there is no marker at all; otherwise they are the script's end
    after its last step, not a step. A capture of some steps only (a window, a ring) begins with
    the events carried into it and the marker of the step before its first: that is no step.
    """
    markers = np.flatnonzero(raw["kind"] == Kind.STEP)
    bounds = [0, *[int(m) for m in markers]]
    numbers = [int(raw["bytes"][m]) for m in markers]
    out: list[StepStat] = []
    head = carried_count(raw)
    for i in range(len(bounds)):
        if i == 0 and len(markers) and int(markers[0]) == head:  # (an empty first step too)
            continue
        start = bounds[i] if i == 0 else bounds[i] + 1
        end = bounds[i + 1] if i + 1 < len(bounds) else len(raw)
        complete = i + 1 < len(bounds)
        if not complete and (end <= start or (not tail and numbers)):
            break
        peak, peak_pos = window_peak(timeline, start, end)
        p1 = timeline.pos_before_row(end)
        t0 = int(raw["t_ns"][bounds[i]]) if i > 0 else t_start_ns
        t1 = int(raw["t_ns"][end]) if complete else t_stop_ns
        out.append(
            StepStat(
                step=numbers[i] if complete else (numbers[-1] + 1 if numbers else 1),
                start_row=start,
                end_row=end,
                t_start_ns=t0,
                t_end_ns=t1,
                peak=peak,
                allocated_at_end=timeline.allocated_at_pos(p1),
                reserved_at_end=timeline.reserved_before_row(end),
                complete=complete,
                peak_pos=peak_pos,
            )
        )
    return out


# Marks (Kind.MARK) the capture writes at the start and end of every collection of Python's cyclic
# garbage collector (gc.callbacks)
def mark_windows(raw: Events, strings: Sequence[str], start: str, stop: str) -> list[tuple[int, int, int, int]]:
    """(thread, start row, stop row, start mark's string id) of each pair of `start` and `stop`
    marks (Kind.MARK) on one thread, in the interval form of `scopes.inside`; sorted by thread, then row."""
    start_ids = [i for i, s in enumerate(strings) if s == start]
    if not start_ids:  # never marked: no pass over the events
        return []
    stop_ids = [i for i, s in enumerate(strings) if s == stop]
    marks = np.flatnonzero(raw["kind"] == Kind.MARK)
    if len(marks) == 0:
        return []
    marks = marks[np.isin(raw["scope"][marks], start_ids + stop_ids)]
    # a stop closes the start just before it on its thread (a start with no stop before the next start
    # is dropped, and so is a stop with no start before it): vectorized, a capture holds a pair of
    # marks per garbage collection, thousands of them
    threads = raw["thread"][marks].astype(np.int64)
    order = np.lexsort((marks, threads))
    marks, threads = marks[order], threads[order]
    is_start = np.isin(raw["scope"][marks], start_ids)
    pair = np.flatnonzero((threads[1:] == threads[:-1]) & is_start[:-1] & ~is_start[1:])
    return [(t, b, e, start_ids[0]) for t, b, e in zip(threads[pair].tolist(), marks[pair].tolist(),
                                                         marks[pair + 1].tolist(), strict=True)]

