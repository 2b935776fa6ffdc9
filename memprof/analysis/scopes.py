"""Scope intervals: RecordFunction begin/end events paired per thread, defined once.

The pairing rule (`pair`): an end closes the innermost open scope of its id on its thread, and
any scopes opened inside it and not yet closed with it (their ends were not seen); an end with no
open scope of its id is ignored; scopes still open when the events run out stay open. Every view
of scopes (the stack at an event, the slices of a trace, the outermost calls of given scopes, the
top-level scopes inside a call) is this rule applied to the events it concerns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from memprof._events import Events, Kind, ids_for, index_dtype, kind_mask


class Pair(NamedTuple):
    """One scope, as `pair` closed it: indices into the event lists it was given."""

    begin: int
    end: int  # the index of the event that closed it; -1 if still open
    scope: int
    depth: int  # open scopes around it when it began
    closed: bool  # False: closed by an outer scope's end, or never closed (end -1)


def _run(kinds: Sequence[int], scopes: Sequence[int], pairs: list[list[int]]) -> tuple[list[int], list[int]]:
    """The rule over one thread's events: appends (begin, end, scope, depth, closed) columns to
    `pairs` as scopes close, and returns the indices and ids still open, outermost first.

    Linear whatever the events hold: an end that does not close the innermost scope looks its id up
    in a count of the open ones (an end that matches nothing, against thousands open, is ignored at
    once), and the search down the stack for it closes every scope it passes."""
    open_index: list[int] = []
    open_scope: list[int] = []
    count: dict[int, int] = {}
    begin = int(Kind.SCOPE_BEGIN)
    b_col, e_col, s_col, d_col, c_col = pairs
    for i, (kind, scope) in enumerate(zip(kinds, scopes, strict=True)):
        if kind == begin:
            open_index.append(i)
            open_scope.append(scope)
            count[scope] = count.get(scope, 0) + 1
        elif open_scope and open_scope[-1] == scope:
            count[scope] -= 1
            open_scope.pop()
            b_col.append(open_index.pop())
            e_col.append(i)
            s_col.append(scope)
            d_col.append(len(open_scope))
            c_col.append(1)
        elif count.get(scope, 0):
            while True:  # close the scopes opened inside it (their ends were not seen), then it
                inner = open_scope.pop()
                count[inner] -= 1
                b_col.append(open_index.pop())
                e_col.append(i)
                s_col.append(inner)
                d_col.append(len(open_scope))
                c_col.append(int(inner == scope))
                if inner == scope:
                    break
    return open_index, open_scope


def pair(kinds: Sequence[int], scopes: Sequence[int]) -> list[Pair]:
    """Pair one thread's begin/end events (in order) by the rule above; in the order they close,
    then the ones left open, innermost first."""
    cols: list[list[int]] = [[], [], [], [], []]
    left, left_scope = _run(kinds, scopes, cols)
    out = [Pair(b, e, s, d, bool(c)) for b, e, s, d, c in zip(*cols, strict=True)]
    out += [Pair(left[k], -1, left_scope[k], k, False) for k in range(len(left) - 1, -1, -1)]
    return out


def _level_pairs(is_begin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Pairs by nesting depth alone: each begin with the next event at its depth (begin index, end
    index or -1, depth, has an end); None where an end would take the depth below zero. (In int32
    and int8 where they hold the values: a thread of millions of scope events pairs in a few of its
    event counts' worth of memory.)"""
    n = len(is_begin)
    idx_t = index_dtype(n)
    step = is_begin.astype(np.int8)
    step *= 2
    step -= 1
    after = np.cumsum(step, dtype=idx_t)
    del step
    if n and int(after.min()) < 0:
        return None
    # A begin at depth d and the end that brings the depth back to d are consecutive among the
    # events at level d (no other begin at d can come between them), so pairs are neighbours.
    level = after - is_begin
    del after
    order = np.argsort(level.astype(np.int16) if n and int(level.max()) < 2**15 else level, kind="stable")
    order = order.astype(idx_t, copy=False)
    lv, ib = level[order], is_begin[order]
    del level
    at = np.flatnonzero(ib).astype(idx_t, copy=False)
    nxt = np.minimum(at + 1, n - 1)
    has_end = (at + 1 < n) & (lv[nxt] == lv[at]) & ~ib[nxt]
    del ib  # (each array is let go once used: a thread of millions of scope events pairs here)
    depth = lv[at]
    del lv
    end = order[nxt]
    del nxt
    end[~has_end] = -1
    return order[at], end, depth, has_end


def pair_arrays(kinds: np.ndarray, scopes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`pair` in columns: begin index, end index (-1: open), depth and closed of each scope, in no
    particular order, without a loop over the events where they are what captures hold: every
    end closes the innermost open scope (pairs by depth alone), except begins whose end was never
    recorded (Dynamo's `*_data` scopes during a compile), which the rule closes with the end of the
    scope around them. Those are found in a few passes (a pass takes out the innermost begins paired
    with an end of another id) and checked to be that case; anything else (stray ends) goes to
    `pair` itself, so both give the rule's pairs."""
    is_begin = np.asarray(kinds) == Kind.SCOPE_BEGIN
    scopes = np.asarray(scopes)
    keep = np.ones(len(is_begin), bool)
    removed: list[np.ndarray] = []
    partners: list[np.ndarray] = []
    idx_t = index_dtype(len(is_begin))
    for _ in range(_REPAIR_PASSES):
        # (the first pass takes every event: no index array of them all)
        idx = np.flatnonzero(keep).astype(idx_t, copy=False) if removed else None
        found = _level_pairs(is_begin if idx is None else is_begin[idx])
        if found is None:
            break
        b, e, _depth, has_end = found
        eb, ee = (b, np.maximum(e, 0)) if idx is None else (idx[b], idx[np.maximum(e, 0)])
        bad = np.flatnonzero(has_end & (scopes[eb] != scopes[ee]))
        del eb, ee
        if not len(bad):
            out = _with_unended(is_begin, idx, found, np.concatenate([np.zeros(0, np.int64), *removed]),
                                np.concatenate([np.zeros(0, np.int64), *partners]), scopes)
            if out is not None:
                return out
            break
        bad = bad[np.argsort(b[bad])]
        inner = bad[np.append(b[bad][1:] > e[bad][:-1], True)]  # no mismatched pair inside it
        at_b, at_e = (b[inner], e[inner]) if idx is None else (idx[b[inner]], idx[e[inner]])
        keep[at_b] = False
        removed.append(at_b)
        partners.append(at_e)
    cols: list[list[int]] = [[], [], [], [], []]
    left, _ = _run(np.asarray(kinds).tolist(), scopes.tolist(), cols)
    return (np.asarray(cols[0] + left, np.int64), np.asarray(cols[1] + [-1] * len(left), np.int64),
            np.asarray(cols[3] + list(range(len(left))), np.int64), np.asarray(cols[4] + [0] * len(left), bool))


_REPAIR_PASSES = 8  # nestings of begins without an end that the columns take out; deeper ones run `pair`


def _with_unended(is_begin: np.ndarray, idx: np.ndarray | None, found: tuple[np.ndarray, ...], unended: np.ndarray,
                  partners: np.ndarray, scopes: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The rule's pairs from the pairs `found` of the events `idx` (all but the begins `unended`):
    an unended begin is closed, not by its own end, by the end of the innermost scope around it,
    which must be the end it was paired with when taken out (`partners`) and of another id; it
    stays on the stack until then, so the scopes that begin meanwhile are one deeper. None where
    that does not hold. `idx` None: every event (nothing taken out)."""
    b, e, depth, has_end = found
    if idx is None:
        return b, e, depth, has_end
    begin, end = idx[b], np.where(e >= 0, idx[np.maximum(e, 0)], -1)
    if not len(unended):
        return begin, end, depth, has_end
    # the kept scopes open at each unended begin, and the innermost of them: the last kept begin
    # before it one level out (kept scopes nest properly)
    level = np.concatenate([[0], np.cumsum(np.where(is_begin[idx], 1, -1))])[np.searchsorted(idx, unended)]
    span = len(scopes) + 1
    keys = depth.astype(np.int64) * span + begin
    order = np.argsort(keys)
    j = np.searchsorted(keys[order], (level - 1) * span + unended) - 1
    parent = order[np.maximum(j, 0)]
    if np.any(level < 1) or np.any(j < 0) or np.any(depth[parent] != level - 1):
        return None
    closer = end[parent]
    if np.any(closer != partners) or np.any(scopes[begin[parent]] == scopes[unended]):
        return None
    cover = np.zeros(span, np.int64)  # unended scopes on the stack, by event index
    np.add.at(cover, unended + 1, 1)
    np.add.at(cover, closer, -1)
    cover = np.cumsum(cover)
    return (np.concatenate([begin, unended]).astype(np.int64), np.concatenate([end, closer]).astype(np.int64),
            np.concatenate([depth + cover[begin], level + cover[unended]]),
            np.concatenate([has_end, np.zeros(len(unended), bool)]))


@dataclass(frozen=True)
class SliceTable:
    """Scopes on their threads (ops, kernels, compiled-graph calls) in columns, one row per scope."""

    thread: np.ndarray
    scope: np.ndarray
    t_begin_ns: np.ndarray
    t_end_ns: np.ndarray
    depth: np.ndarray  # open scopes around it on its thread when it began
    closed: np.ndarray  # False: still open when the capture stopped (or its end was not seen)
    begin_row: np.ndarray  # event rows of its begin and end (len(raw): not closed)
    end_row: np.ndarray

    def __len__(self) -> int:
        return len(self.thread)


class ScopeIndex:
    """The scope events of a capture, per thread (built once per capture, O(scope events))."""

    def __init__(self, raw: Events) -> None:
        self.raw = raw
        rows = np.flatnonzero(kind_mask(raw["kind"], (Kind.SCOPE_BEGIN, Kind.SCOPE_END)))
        rows = rows.astype(index_dtype(len(raw)), copy=False)
        self.threads: list[int] = []  # in order of their first scope event
        self._rows: dict[int, np.ndarray] = {}
        self._pairs_of: dict[int, tuple[np.ndarray, ...]] = {}
        if not len(rows):
            return
        column = raw["thread"]
        if column.strides == (0,):  # one thread made every event (the column holds one value)
            self.threads, self._rows = [int(column[0])], {int(column[0]): rows}
            return
        threads = column[rows]
        uniq, first = np.unique(threads, return_index=True)
        for t in uniq[np.argsort(first)].tolist():
            self.threads.append(int(t))
            self._rows[int(t)] = rows if len(uniq) == 1 else rows[threads == t]

    def rows_on(self, thread: int) -> np.ndarray:
        """Rows of the scope events on `thread`, in order."""
        return self._rows.get(thread, np.zeros(0, np.int64))

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
        """The scopes that began before `row` and closed at it or later: open just before it."""
        if thread not in self._rows:
            return []
        if thread in self._pairs_of:
            begin_row, end_row, depth, _closed, scope = self._thread_pairs(thread)
        else:  # the events before `row` paired alone (the rule is causal): those left open are open at `row`
            rows = self.rows_on(thread)
            begin_row, end_row, depth, _closed, scope = self._pairs(rows[: int(np.searchsorted(rows, row))])
        at = np.flatnonzero((begin_row < row) & (end_row >= row))
        return [int(s) for s in scope[at[np.argsort(depth[at], kind="stable")]]]

    def _thread_pairs(self, thread: int) -> tuple[np.ndarray, ...]:
        """The rule's pairs on one thread (computed once): begin row, end row (len(raw): open), depth,
        closed, scope."""
        if thread not in self._pairs_of:
            self._pairs_of[thread] = self._pairs(self.rows_on(thread))
        return self._pairs_of[thread]

    def _pairs(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        raw = self.raw
        b, e, depth, closed = pair_arrays(raw["kind"][rows], raw["scope"][rows])
        end_row = np.where(e >= 0, rows[np.maximum(e, 0)], len(raw))
        return rows[b], end_row, depth, closed, raw["scope"][rows[b]]

    def slice_table(self, t_stop_ns: int) -> SliceTable:
        """Every scope as a slice, in columns (a long capture has hundreds of thousands), in the order
        they begin, the outer one first where several begin at one event time; a scope open at
        the stop ends there (`closed` False, `end_row` len(raw))."""
        raw, t = self.raw, self.raw["t_ns"]
        parts: list[tuple[np.ndarray, ...]] = []
        for thread in self.threads:
            begin_row, end_row, depth, closed, scope = self._thread_pairs(thread)
            t0 = t[begin_row].astype(np.int64)
            is_open = end_row >= len(raw)
            t1 = np.where(is_open, np.maximum(t0, t_stop_ns), t[np.minimum(end_row, len(raw) - 1)]).astype(np.int64)
            parts.append((np.full(len(scope), thread, np.int64), scope, t0, t1, depth, closed, begin_row, end_row))
        if not parts:
            empty = np.zeros(0, np.int64)
            return SliceTable(empty, empty, empty, empty, empty, np.zeros(0, bool), empty, empty)
        cols = [np.concatenate(c) for c in zip(*parts, strict=True)]
        order = np.lexsort((cols[6], -(cols[3] - cols[2]), cols[2]))  # by begin time, longest first, then row
        return SliceTable(*(c[order] for c in cols))

    def outermost(self, scope_ids: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """(thread, begin row, end row, scope) of the given scopes, outermost per nesting among them
        (other scopes ignored); one still open ends at len(raw). Sorted by thread, then row."""
        if not len(scope_ids):
            return []
        raw = self.raw
        ids = ids_for(raw["scope"], scope_ids)
        out: list[tuple[int, int, int, int]] = []
        for thread in self.threads:
            rows = self.rows_on(thread)
            rows = rows[np.isin(raw["scope"][rows], ids)]
            b, e, depth, _closed = pair_arrays(raw["kind"][rows], raw["scope"][rows])
            top = depth == 0
            begins = rows[b[top]]
            ends = np.where(e[top] >= 0, rows[np.maximum(e[top], 0)], len(raw))
            out += zip([thread] * len(begins), begins.tolist(), ends.tolist(), raw["scope"][begins].tolist(),
                       strict=True)
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
            inner = inner[np.isin(raw["scope"][inner], ids_for(raw["scope"], scope_ids))]
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
    (intervals do not overlap per thread), in the smallest integer type that holds them (int8 for a
    capture's few optimizer steps or compiled calls: one per allocation of millions)."""
    out = np.full(len(rows), -1, dtype=np.min_scalar_type(-max(len(intervals), 1)))
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
        res = np.full(len(r), -1, dtype=out.dtype)
        res[ok] = sel[j[ok]]
        out[mask] = res
    return out
