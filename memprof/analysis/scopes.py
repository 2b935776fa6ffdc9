"""Scope intervals: RecordFunction begin/end events paired per thread, defined once.

The pairing rule (`pair`): an end closes the innermost open scope of its id on its thread, and
any scopes opened inside it and not yet closed with it (their ends were not seen); an end with no
open scope of its id is ignored; scopes still open when the events run out stay open. Every view
of scopes (the stack at an event, the slices of a trace, the outermost calls of given scopes, the
top-level scopes inside a call) is this rule applied to the events it concerns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from memprof._events import Kind


class Pair(NamedTuple):
    """One scope, as `pair` closed it: indices into the event lists it was given."""

    begin: int
    end: int  # the index of the event that closed it; -1 if still open
    scope: int
    depth: int  # open scopes around it when it began
    closed: bool  # False: closed by an outer scope's end, or never closed (end -1)


class _Open:
    """One thread's open scopes, with where each id is open: the rule's search (the innermost open scope
    of an id) in constant time, so a thread's events pair in linear time whatever they hold (an end
    that matches nothing, against thousands open, is ignored at once)."""

    def __init__(self) -> None:
        self.stack: list[tuple[int, int]] = []  # (index, scope)
        self.where: dict[int, list[int]] = {}  # scope -> its positions in the stack, innermost last

    def begin(self, index: int, scope: int) -> None:
        self.where.setdefault(scope, []).append(len(self.stack))
        self.stack.append((index, scope))

    def match(self, scope: int) -> int:
        """The position of the innermost open scope with this id (-1: none, the end is ignored)."""
        at = self.where.get(scope)
        return at[-1] if at else -1

    def pop(self) -> tuple[int, int]:
        index, scope = self.stack.pop()
        self.where[scope].pop()
        return index, scope


def pair(kinds: Sequence[int], scopes: Sequence[int]) -> list[Pair]:
    """Pair one thread's begin/end events (in order) by the rule above; in the order they close,
    then the ones left open, innermost first."""
    open_ = _Open()
    out: list[Pair] = []
    for i, (kind, scope) in enumerate(zip(kinds, scopes, strict=True)):
        if kind == Kind.SCOPE_BEGIN:
            open_.begin(i, scope)
            continue
        j = open_.match(scope)
        if j >= 0:
            while len(open_.stack) > j:
                b, s = open_.pop()
                out.append(Pair(b, i, s, len(open_.stack), len(open_.stack) == j))
    while open_.stack:
        b, s = open_.pop()
        out.append(Pair(b, -1, s, len(open_.stack), False))
    return out


def open_scopes(kinds: Sequence[int], scopes: Sequence[int]) -> list[int]:
    """The scope ids still open (outermost first) after one thread's events, by the same rule as
    `pair` (without building the pairs: the stack at one event of a long capture)."""
    open_ = _Open()
    for i, (kind, scope) in enumerate(zip(kinds, scopes, strict=True)):
        if kind == Kind.SCOPE_BEGIN:
            open_.begin(i, scope)
        elif (j := open_.match(scope)) >= 0:
            while len(open_.stack) > j:
                open_.pop()
    return [s for _i, s in open_.stack]


class Slice(NamedTuple):
    """A scope on one thread (an op, a kernel or a compiled graph call)."""

    thread: int
    scope: int
    t_begin_ns: int
    t_end_ns: int
    depth: int
    closed: bool  # False: still open when the capture stopped (or its end was not seen)


class ScopeIndex:
    """The scope events of a capture, per thread (built once per capture, O(scope events))."""

    def __init__(self, raw: np.ndarray) -> None:
        self.raw = raw
        kinds = raw["kind"]
        rows = np.flatnonzero((kinds == Kind.SCOPE_BEGIN) | (kinds == Kind.SCOPE_END)).astype(np.int64)
        threads = raw["thread"][rows]
        self.threads: list[int] = []  # in order of their first scope event
        self._rows: dict[int, np.ndarray] = {}
        if len(rows):
            uniq, first = np.unique(threads, return_index=True)
            for t in uniq[np.argsort(first)].tolist():
                self.threads.append(int(t))
                self._rows[int(t)] = rows[threads == t]

    def rows_on(self, thread: int) -> np.ndarray:
        """Rows of the scope events on `thread`, in order."""
        return self._rows.get(thread, np.zeros(0, np.int64))

    def _pairs(self, rows: np.ndarray) -> list[Pair]:
        return pair(self.raw["kind"][rows].tolist(), self.raw["scope"][rows].tolist())

    def stack_at(self, row: int, fallback_thread: int | None = None) -> list[int]:
        """Open scope ids (outermost first) on the thread of event `row`, just before it.

        An event on a thread with no scope open (an intra-op worker thread allocating a kernel's
        buffer, a data pipeline's thread) gets the stack `fallback_thread` (the capturing thread)
        had then."""
        thread = int(self.raw["thread"][row])
        stack = self._stack_on(thread, row)
        if not stack and fallback_thread is not None and fallback_thread != thread:
            stack = self._stack_on(fallback_thread, row)
        return stack

    def _stack_on(self, thread: int, row: int) -> list[int]:
        rows = self.rows_on(thread)
        rows = rows[: int(np.searchsorted(rows, row, side="left"))]
        return open_scopes(self.raw["kind"][rows].tolist(), self.raw["scope"][rows].tolist())

    def slices(self, t_stop_ns: int) -> list[Slice]:
        """Every scope as a slice, in the order they close (scopes open at the stop end there)."""
        t = self.raw["t_ns"]
        keyed: list[tuple[int, int, Slice]] = []
        for order, thread in enumerate(self.threads):
            rows = self.rows_on(thread)
            for k, p in enumerate(self._pairs(rows)):
                t0 = int(t[rows[p.begin]])
                if p.end >= 0:
                    keyed.append((int(rows[p.end]), k, Slice(thread, p.scope, t0, int(t[rows[p.end]]), p.depth,
                                                              p.closed)))
                else:
                    keyed.append((len(self.raw) + order, k, Slice(thread, p.scope, t0, max(t0, t_stop_ns),
                                                                  p.depth, False)))
        keyed.sort(key=lambda x: (x[0], x[1]))
        return [s for _r, _k, s in keyed]

    def outermost(self, scope_ids: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """(thread, begin row, end row, scope) of the given scopes, outermost per nesting among them
        (other scopes ignored); one still open ends at len(raw). Sorted by thread, then row."""
        if not len(scope_ids):
            return []
        raw = self.raw
        ids = np.asarray(scope_ids, dtype=raw["scope"].dtype)
        out: list[tuple[int, int, int, int]] = []
        for thread in self.threads:
            rows = self.rows_on(thread)
            rows = rows[np.isin(raw["scope"][rows], ids)]
            for p in self._pairs(rows):
                if p.depth == 0:
                    out.append((thread, int(rows[p.begin]), int(rows[p.end]) if p.end >= 0 else len(raw), p.scope))
        out.sort(key=lambda x: (x[0], x[1]))
        return out

    def children(self, thread: int, begin: int, end: int, scope_ids: Sequence[int] | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The top-level scopes inside rows (begin, end) on `thread` among `scope_ids` (None: all):
        their begin rows, end rows (`end` when not closed inside) and scope ids. Counted by depth
        (vectorized: a call may hold thousands of kernel launches)."""
        raw = self.raw
        rows = self.rows_on(thread)
        inner = rows[np.searchsorted(rows, begin, side="right"):np.searchsorted(rows, end, side="left")]
        if scope_ids is not None:
            inner = inner[np.isin(raw["scope"][inner], np.asarray(list(scope_ids), dtype=raw["scope"].dtype))]
        step = np.where(raw["kind"][inner] == Kind.SCOPE_BEGIN, 1, -1)
        depth = np.cumsum(step)
        top_begin = np.flatnonzero((step == 1) & (depth == 1))
        closes = np.flatnonzero(depth == 0)
        j = np.searchsorted(closes, top_begin)
        child_b = inner[top_begin]
        if len(closes):
            child_e = np.where(j < len(closes), inner[closes[np.minimum(j, len(closes) - 1)]], end)
        else:
            child_e = np.full(len(top_begin), end, dtype=np.int64)
        return child_b, np.asarray(child_e, dtype=np.int64), raw["scope"][child_b]


def inside(rows: np.ndarray, threads: np.ndarray, intervals: Sequence[tuple[int, int, int, int]]) -> np.ndarray:
    """Index of the interval (`ScopeIndex.outermost`) containing each (row, thread), -1 if none
    (intervals do not overlap per thread)."""
    out = np.full(len(rows), -1, dtype=np.int64)
    if not intervals:
        return out
    arr = np.asarray(intervals, dtype=np.int64)
    for thread in np.unique(arr[:, 0]).tolist():
        sel = np.flatnonzero(arr[:, 0] == thread)
        begins, ends = arr[sel, 1], arr[sel, 2]
        mask = threads == thread
        r = rows[mask]
        j = np.searchsorted(begins, r, side="right") - 1
        ok = (j >= 0) & (r < ends[np.maximum(j, 0)])
        res = np.full(len(r), -1, dtype=np.int64)
        res[ok] = sel[j[ok]]
        out[mask] = res
    return out
