"""Unit tests of the pure timeline analysis on synthetic event arrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memprof._events import (
    EVENT_DTYPE,
    FLAG_UNFOLLOWED_THREAD,
    Events,
    EventsBuilder,
    Kind,
    device_name,
    ids_for,
    parse_device,
)
from memprof.analysis.scopes import ScopeIndex, pair, pair_arrays
from memprof.analysis.timeline import build_timeline, step_stats
from memprof.analysis.view import downsample


def events(*rows: tuple[int, int, int, int] | tuple[int, int, int, int, int]) -> np.ndarray:
    """rows of (kind, bytes, ptr, scope[, flags]) on cuda:0, t_ns = 10 * index."""
    out = np.zeros(len(rows), dtype=EVENT_DTYPE)
    for i, row in enumerate(rows):
        kind, nbytes, ptr, scope = row[:4]
        out[i]["t_ns"] = 10 * i
        out[i]["kind"] = kind
        out[i]["bytes"] = nbytes
        out[i]["ptr"] = ptr
        out[i]["scope"] = scope
        out[i]["aux"] = -1
        out[i]["flags"] = row[4] if len(row) > 4 else 0
        is_mem = kind in (Kind.ALLOC, Kind.FREE, Kind.CUDA_ALLOC, Kind.CUDA_FREE_REQUESTED,
                          Kind.SEGMENT_ALLOC, Kind.SEGMENT_FREE)
        out[i]["device_type"] = 1 if is_mem else -1
        out[i]["device_index"] = 0 if is_mem else -1
    return out


def test_columns_are_stored_narrow_while_every_value_fits_and_widened_once_one_does_not() -> None:
    small = events((Kind.ALLOC, 512, 0x10, 7), (Kind.FREE, -512, 0x10, 7), (Kind.SCOPE_BEGIN, 0, 0, 65535))
    big = events((Kind.ALLOC, 3 << 30, 0x20, 70000), (Kind.FREE, -(3 << 30), 0x20, 7))
    narrow = Events.from_chunks(3, [small])
    assert narrow["bytes"].dtype == np.int32 and narrow["scope"].dtype == np.uint16
    assert narrow["aux"].strides == (0,)  # one value in every event: stored once, as before
    both = Events.from_chunks(5, [small, big])  # a 3 GiB block and string 70,000 come later: widened
    assert both["bytes"].dtype == np.int64 and both["scope"].dtype == np.uint32
    wide = np.concatenate([small, big])
    assert both["bytes"].tolist() == wide["bytes"].tolist() and both["scope"].tolist() == wide["scope"].tolist()
    assert (narrow.records() == small).all()  # the records (what files and spills hold) are unchanged
    # the timeline reads values, not dtypes: the same from narrow columns as from the records
    a, b = build_timeline(narrow, "cuda:0"), build_timeline(Events.of(small), "cuda:0")
    assert a.allocated.dtype == np.int64 and a.allocated.tolist() == b.allocated.tolist() and a.peak == b.peak == 512
    # ids compared with a narrow column: one it cannot hold matches no event (never wraps onto 4,464)
    assert ids_for(narrow["scope"], [7, 70000, 4464 + 65536]).tolist() == [7]


def test_a_chunk_longer_than_the_builders_slice_gives_the_same_columns() -> None:
    """One chunk of 2.5 slices: a field constant in the first slice that varies in the last, and a
    size that needs int64 only in the last, come out as the records hold them."""
    n = EventsBuilder.SLICE * 5 // 2
    recs = np.zeros(n, dtype=EVENT_DTYPE)
    recs["t_ns"] = np.arange(n)
    recs["kind"] = Kind.ALLOC
    recs["bytes"] = 16
    recs["bytes"][-1] = 5 << 30
    recs["thread"][-3:] = 2
    built = Events.from_chunks(n, [recs])
    assert built["bytes"].dtype == np.int64 and built["thread"].strides != (0,)
    assert (built.records() == recs).all()
    assert Events.from_chunks(n, [recs[:7], recs[7:]]).records().tobytes() == recs.tobytes()


def test_device_names_round_trip() -> None:
    assert device_name(0, -1) == "cpu"
    assert device_name(1, 3) == "cuda:3"
    assert parse_device("cuda:3") == (1, 3)
    assert parse_device("cpu") == (0, -1)
    with pytest.raises(ValueError):
        parse_device("gpu")


def test_running_sum_peak_and_pairing() -> None:
    A, F = Kind.ALLOC, Kind.FREE
    raw = events((A, 100, 1, 0), (A, 50, 2, 0), (F, -100, 1, 0), (A, 200, 1, 0), (F, -50, 2, 0), (F, -200, 1, 0))
    tl = build_timeline(raw, "cuda:0", baseline=1000)
    assert tl.allocated.tolist() == [1100, 1150, 1050, 1250, 1200, 1000]
    assert tl.peak == 1250 and tl.peak_pos == 3
    assert tl.free_of.tolist() == [2, 4, -1, 5, -1, -1]
    # live just after the peak: ptr 2 (50 B) and the second allocation of ptr 1 (200 B)
    live = tl.live_positions(tl.peak_pos)
    assert sorted(tl.delta[live].tolist()) == [50, 200]


def test_peak_is_baseline_when_nothing_grows() -> None:
    raw = events((Kind.FREE, -64, 9, 0))
    tl = build_timeline(raw, "cuda:0", baseline=512)
    assert tl.peak == 512 and tl.peak_pos == -1 and tl.final == 448


def test_unfollowed_thread_sizes_are_recovered() -> None:
    A, F = Kind.ALLOC, Kind.FREE
    U, UF = Kind.CUDA_ALLOC, Kind.CUDA_FREE_REQUESTED
    f = FLAG_UNFOLLOWED_THREAD
    raw = events(
        (U, 1000, 7, 0, f),  # unseen allocation, freed by a followed thread: exact size from the free
        (F, -1024, 7, 0),
        (A, 2048, 8, 0),  # followed allocation freed on an unfollowed thread: size from the allocation
        (UF, -2000, 8, 0, f),
        (U, 100, 9, 0, f),  # never freed: rounded to the allocator's 512-byte blocks
    )
    tl = build_timeline(raw, "cuda:0")
    assert tl.delta.tolist() == [1024, -1024, 2048, -2048, 512]
    assert tl.inferred == 1


def test_reserved_from_segments() -> None:
    raw = events((Kind.SEGMENT_ALLOC, 2 << 20, 5, 0), (Kind.ALLOC, 512, 5, 0), (Kind.SEGMENT_FREE, -(2 << 20), 5, 0))
    tl = build_timeline(raw, "cuda:0", reserved_baseline=4 << 20, has_reserved=True)
    assert tl.reserved.tolist() == [6 << 20, 4 << 20]
    assert tl.reserved_peak == 6 << 20
    assert tl.reserved_before_row(2) == 6 << 20


def test_steps_split_at_markers() -> None:
    A, F, S = Kind.ALLOC, Kind.FREE, Kind.STEP
    raw = events((A, 100, 1, 0), (F, -100, 1, 0), (S, 1, 0, 0), (A, 300, 2, 0), (S, 2, 0, 0), (F, -300, 2, 0))
    tl = build_timeline(raw, "cuda:0", baseline=10)
    steps = step_stats(raw, tl, 0, 100)
    assert [(s.step, s.peak, s.allocated_at_end, s.complete) for s in steps] == [
        (1, 110, 10, True), (2, 310, 310, True), (3, 310, 10, False)]


def test_scope_stack_and_slices_nest() -> None:
    B, E, A = Kind.SCOPE_BEGIN, Kind.SCOPE_END, Kind.ALLOC
    raw = events((B, 0, 0, 1), (B, 0, 0, 2), (A, 64, 1, 2), (E, 0, 0, 2), (B, 0, 0, 3), (E, 0, 0, 3), (E, 0, 0, 1),
                 (B, 0, 0, 4))
    assert ScopeIndex(raw).stack_at(2) == [1, 2]
    t = ScopeIndex(raw).slice_table(t_stop_ns=1000)
    spans = list(zip(t.scope.tolist(), t.t_begin_ns.tolist(), t.t_end_ns.tolist(), t.depth.tolist(),
                     t.closed.tolist(), t.begin_row.tolist(), t.end_row.tolist(), strict=True))
    assert spans == [(1, 0, 60, 0, True, 0, 6), (2, 10, 30, 1, True, 1, 3), (3, 40, 50, 1, True, 4, 5),
                     (4, 70, 1000, 0, False, 7, 8)]


def test_downsample_keeps_the_peak_and_ends() -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(0, 1000, 100_000)
    values[77_777] = 10**9
    keep = downsample(values, 1000)
    assert len(keep) <= 1500
    assert 77_777 in keep and 0 in keep and len(values) - 1 in keep
    assert values[keep].max() == values.max() and values[keep].min() == values.min()


def test_blocks_live_at_the_start_are_labelled_and_freed() -> None:
    from memprof.analysis.attribution import category_series, label_timeline, rows_at

    # before the capture: a parameter block at 0x100 (2048 B), an unknown block at 0x200 (512 B),
    # and 1024 B the snapshot missed; during it: one allocation, then the unknown block is freed.
    raw = events((Kind.ALLOC, 4096, 0x300, 0), (Kind.FREE, -512, 0x200, 0), (Kind.FREE, -4096, 0x300, 0))
    tl = build_timeline(raw, "cuda:0", baseline=2048 + 512 + 1024)
    tensors = [(5, "cuda:0", 0x100, 2048, "parameter", "layers.0.w")]
    labels = label_timeline(raw, [""], tl, tensors=tensors, preexisting=[(0x100, 2048), (0x200, 512)])
    at_alloc = {r.key: r.bytes for r in rows_at(tl, labels, 0, "category")}
    # an eager allocation before any forward/backward activity counts as input
    assert at_alloc == {"parameter": 2048, "input": 4096, "unattributed": 512 + 1024}
    nodes = {r.key: r.bytes for r in rows_at(tl, labels, 1, "node")}
    assert nodes["parameter:layers.0.w"] == 2048 and nodes["(allocated before the capture)"] == 1024
    layers = {r.key for r in rows_at(tl, labels, 1, "layer")}
    assert "layers.0" in layers
    series = category_series(tl, labels)
    assert (series.sum(axis=1) == tl.allocated).all() and (series >= 0).all()
    # a snapshot larger than the baseline is not trusted: everything before stays unattributed
    wrong = label_timeline(raw, [""], tl, tensors=tensors, preexisting=[(0x100, 1 << 20)])
    assert {r.key: r.bytes for r in rows_at(tl, wrong, 1, "category")}["unattributed"] == 2048 + 1024


def test_an_unscoped_worker_thread_event_takes_the_capturing_threads_stack() -> None:
    B, A = Kind.SCOPE_BEGIN, Kind.ALLOC
    raw = events((B, 0, 0, 1), (B, 0, 0, 2), (A, 64, 1, 0))
    raw["thread"][2] = 3  # an intra-op worker allocating inside the op the main thread runs
    assert ScopeIndex(raw).stack_at(2) == []
    assert ScopeIndex(raw).stack_at(2, fallback_thread=0) == [1, 2]


def test_one_pairing_rule_for_every_view_of_scopes() -> None:
    B, E = Kind.SCOPE_BEGIN, Kind.SCOPE_END
    # 1 opens 2 and 3; 3 never ends (its end was not seen), 1's end closes it; an end of 9 with no
    # open 9 is ignored; 5 is still open at the stop
    kinds = [B, B, E, B, E, E, B]
    scopes = [1, 2, 2, 3, 9, 1, 5]
    assert [(p.begin, p.end, p.scope, p.depth, p.closed) for p in pair(kinds, scopes)] == [
        (1, 2, 2, 1, True), (3, 5, 3, 1, False), (0, 5, 1, 0, True), (6, -1, 5, 0, False)]
    raw = events(*[(k, 0, 0, s) for k, s in zip(kinds, scopes, strict=True)])
    index = ScopeIndex(raw)
    assert index.outermost([1, 5]) == [(0, 0, 5, 1), (0, 6, 7, 5)]
    assert index.outermost([3]) == [(0, 3, 7, 3)]  # among scopes 3 alone, it never ends
    assert index.stack_at(4) == [1, 3] and index.stack_at(6) == []
    begins, ends, ids = index.children(0, 0, 5, [2, 3])
    assert begins.tolist() == [1, 3] and ends.tolist() == [2, 5] and ids.tolist() == [2, 3]
    t = index.slice_table(t_stop_ns=1000)  # the columns give the same pairs (here from `pair` itself)
    assert sorted(zip(t.begin_row.tolist(), t.end_row.tolist(), t.depth.tolist(), t.closed.tolist(),
                      strict=True)) == [(0, 5, 0, True), (1, 2, 1, True), (3, 5, 1, False), (6, 7, 0, False)]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["begin", "end", "stray end", "no end"]), st.integers(0, 3)),
                max_size=24))
def test_the_columnar_pairing_is_the_rule(ops: list[tuple[str, int]]) -> None:
    B, E = Kind.SCOPE_BEGIN, Kind.SCOPE_END
    kinds: list[int] = []
    scopes: list[int] = []
    open_: list[int] = []
    for op, scope in ops:  # mostly nested (what captures hold), with stray ends and ends never recorded
        if op == "begin" or (op in ("end", "no end") and not open_):
            open_.append(scope)
            kinds.append(B)
            scopes.append(scope)
        elif op == "no end":  # (Dynamo's `*_data` scopes: the rule closes them with the scope around)
            open_.pop()
        else:
            kinds.append(E)
            scopes.append(open_.pop() if op == "end" else scope)
    got = pair_arrays(np.asarray(kinds), np.asarray(scopes))
    assert sorted(zip(*(c.tolist() for c in got), strict=True)) == sorted(
        (p.begin, p.end, p.depth, p.closed) for p in pair(kinds, scopes))


def test_begins_without_their_end_are_paired_in_columns_as_the_rule_pairs_them() -> None:
    """A compile's capture holds begins whose end is never recorded, closed by the scope around them:
    the columns take them out and put them back (no loop over the events), and agree with the rule."""
    import memprof.analysis.scopes as scopes_mod

    B, E = Kind.SCOPE_BEGIN, Kind.SCOPE_END
    # 1 [2 [3 (no end)] 4 [5] ] : the end of 2 closes 3; 4 and 5 begin inside 2 (3 is gone by then)
    # then 6 [7 (no end) [8 (no end)] 9 [] ] : 7 and 8 both close at 6's end; 9 is two deeper
    kinds = [B, B, B, E, B, B, E, E, E, B, B, B, B, E, E]
    scopes = [1, 2, 3, 2, 4, 5, 5, 4, 1, 6, 7, 8, 9, 9, 6]
    calls = []
    real = scopes_mod._run
    scopes_mod._run = lambda *a: calls.append(1) or real(*a)  # type: ignore[assignment, func-returns-value]
    try:
        got = pair_arrays(np.asarray(kinds), np.asarray(scopes))
    finally:
        scopes_mod._run = real
    assert not calls
    assert sorted(zip(*(c.tolist() for c in got), strict=True)) == sorted(
        (p.begin, p.end, p.depth, p.closed) for p in pair(kinds, scopes))
    assert (2, 3, 2, False) in sorted(zip(*(c.tolist() for c in got), strict=True))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.sampled_from([1, 2, 3])), max_size=40))
def test_marks_pair_as_each_threads_last_start_closed_by_its_stop(marks: list[tuple[int, int]]) -> None:
    """`mark_windows` (in columns) pairs a stop with the start just before it on its thread, as one
    walk of the marks in order does; other marks (id 3) and other threads do not interfere."""
    from memprof.analysis.timeline import mark_windows

    raw = events(*[(Kind.MARK, 0, 0, scope) for _thread, scope in marks])
    raw["thread"] = [thread for thread, _scope in marks]
    strings = ["", "start", "stop", "other"]
    expected, open_at = [], {}
    for row, (thread, scope) in enumerate(marks):
        if scope == 1:
            open_at[thread] = row
        elif scope == 2 and thread in open_at:
            expected.append((thread, open_at.pop(thread), row, 1))
    assert mark_windows(raw, strings, "start", "stop") == sorted(expected)
