"""The remat pass's liveness walk (`memprof.remat.graph.walk`, on arrays) equals the walk as first
written, one node at a time (kept here as the reference), on random programs: peak, where, area,
the bytes live at the start, what is live at the peak and each storage's last use."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from memprof.remat.graph import (
    _FUSIBLE_CONSUMER,
    HEAVY,
    INPUT,
    ITEM,
    POINTWISE,
    REDUCTION,
    VIEW,
    Node,
    NodeArrays,
    Walk,
    walk,
)


def _sinks_reference(nodes: Sequence[Node], order: Sequence[int], present: set[int], keep: set[int]) -> dict[int, int]:
    """Fused pointwise nodes allocate nothing; their uses happen at their consumer (the "sink")."""
    users: dict[int, list[int]] = {}  # users inside the program
    for j in order:
        for k in nodes[j].inputs:
            if k in present:
                users.setdefault(k, []).append(j)
    sink: dict[int, int] = {}
    for j in reversed(order):
        nd = nodes[j]
        us = users.get(j)
        if (nd.kind == POINTWISE and nd.nbytes > 0 and j not in keep and us is not None and len(us) == 1
                and nodes[us[0]].kind in _FUSIBLE_CONSUMER):
            u = us[0]
            sink[j] = sink.get(u, u)
    return sink


def _last_uses_reference(nodes: Sequence[Node], order: Sequence[int], present: set[int], pos: dict[int, int],
               sink: dict[int, int], roots: dict[int, int]) -> dict[int, int]:
    """Storage root -> the last position that reads it."""
    last: dict[int, int] = {}
    for j in order:
        at = pos[sink.get(j, j)]
        for k in nodes[j].inputs:
            if k in present:
                r = roots[k]
                if last.get(r, -2) < at:
                    last[r] = at
    return last


def walk_reference(nodes: Sequence[Node], order: Sequence[int], start: Iterable[int] = (), keep: Iterable[int] = (),
         fuse: bool = True, detail: bool = True) -> Walk:
    """Estimate the peak of running `order` with `start` live at entry and `keep` live at exit.

    `order` lists node indices to execute; inputs of executed nodes must be in `start` or
    executed earlier (or be resident). Positions in the result refer to `order`.
    """
    n_steps = len(order)
    start_set = set(start)
    keep_set = set(keep)
    present = start_set.union(order)
    pos = {j: p for p, j in enumerate(order)}
    for j in start_set:
        pos.setdefault(j, -1)
    sink = _sinks_reference(nodes, order, present, keep_set) if fuse else {}

    def root(j: int) -> int:
        a = nodes[j].alias
        while a >= 0 and a in present:
            j, a = a, nodes[a].alias
        return j

    roots = {j: root(j) for j in present}
    last = _last_uses_reference(nodes, order, present, pos, sink, roots)
    for j in keep_set:
        if j in present:
            last[roots[j]] = n_steps
    live = 0
    for j in start_set:
        nd = nodes[j]
        if roots[j] == j and not nd.resident:
            live += nd.nbytes
    start_bytes = live
    frees: dict[int, list[int]] = {}
    span: dict[int, tuple[int, int]] = {}  # root -> (allocated at, freed after)
    for j in start_set:
        if roots[j] == j and not nodes[j].resident and nodes[j].nbytes:
            p = last.get(j, -1)
            span[j] = (-1, p)
            if p < 0:
                live -= nodes[j].nbytes
            else:
                frees.setdefault(p, []).append(j)
    peak, peak_at, area = live, -1, 0
    for p, j in enumerate(order):
        nd = nodes[j]
        if nd.nbytes and roots[j] == j and j not in sink and not nd.resident:
            live += nd.nbytes
            end = max(last.get(j, p), p)
            frees.setdefault(end, []).append(j)
            span[j] = (p, end)
            if live > peak:
                peak, peak_at = live, p
        area += live
        for r in frees.pop(p, ()):
            live -= nodes[r].nbytes
    at_peak: list[int] = []
    if detail:
        at_peak = sorted(r for r, (a, e) in span.items() if a <= peak_at and e >= max(peak_at, 0)
                         and not (peak_at < 0 and e < 0))
    return Walk(peak, peak_at, area, start_bytes, at_peak, last if detail else {})



KINDS = [POINTWISE, POINTWISE, POINTWISE, VIEW, ITEM, REDUCTION, HEAVY, INPUT]


@st.composite
def programs(draw: Any) -> tuple[list[Node], list[int], list[int], list[int]]:
    """Nodes in topological order (inputs earlier, repeats allowed; views alias their first input),
    a program over some of them, the values live at its start and those kept at its end."""
    n = draw(st.integers(1, 24))
    nodes: list[Node] = []
    for j in range(n):
        kind = draw(st.sampled_from(KINDS)) if j else INPUT
        inputs = tuple(draw(st.lists(st.integers(0, j - 1), min_size=1, max_size=3))) if j and kind != INPUT else ()
        alias = inputs[0] if kind == VIEW and inputs else -1
        nbytes = 0 if alias >= 0 else draw(st.sampled_from([0, 1, 8, 100, 4096]))
        nodes.append(Node(f"n{j}", kind, inputs, nbytes, alias, resident=kind == INPUT and draw(st.booleans())))
    role = draw(st.lists(st.sampled_from(["run", "run", "start", "none"]), min_size=n, max_size=n))
    order = [j for j in range(n) if role[j] == "run"]
    start = [j for j in range(n) if role[j] == "start"]
    keep = [j for j, k in enumerate(draw(st.lists(st.booleans(), min_size=n, max_size=n))) if k]
    return nodes, order, start, keep


@settings(max_examples=600, deadline=None)
@given(programs(), st.booleans())
def test_the_walk_on_arrays_is_the_walk_one_node_at_a_time(
        program: tuple[list[Node], list[int], list[int], list[int]], fuse: bool) -> None:
    nodes, order, start, keep = program
    expected = walk_reference(nodes, order, start, keep, fuse=fuse)
    assert walk(nodes, order, start, keep, fuse=fuse) == expected
    assert walk(NodeArrays.of(nodes), order, set(start), keep, fuse=fuse) == expected
