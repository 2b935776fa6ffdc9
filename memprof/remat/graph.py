"""Plain-data graphs and the peak-memory estimate the remat pass decides with (pure; no torch).

A graph is a list of `Node`s in one topological order; `inputs` are indices into that list. The
estimate walks a program (an execution order over those nodes) the way Inductor runs a graph:
- a node allocates its bytes when it runs and frees them after the last use of its storage
  (views and `getitem` share their base's storage, `alias`);
- a pointwise node whose only consumer is another pointwise op or a reduction is fused into it
  and allocates nothing; its inputs live until that consumer runs;
- program inputs that are not resident (saved activations, tangents) are live from the start and
  freed after their last use (AOTAutograd steals the backward's arguments); resident inputs
  (parameters, user inputs) cost nothing; outputs stay live to the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

POINTWISE = "pointwise"
VIEW = "view"
ITEM = "item"  # one output of a multi-output op (getitem): its own storage, allocated with its parent
REDUCTION = "reduction"
HEAVY = "heavy"  # matrix multiplies, convolutions
ATTENTION = "attention"
RANDOM = "random"
OTHER = "other"
INPUT = "input"
OUTPUT = "output"

_FUSIBLE_CONSUMER = (POINTWISE, REDUCTION)


@dataclass(slots=True)
class Node:
    """One value-producing operation (or a graph input/output), as plain data."""

    name: str
    kind: str  # one of the constants above
    inputs: tuple[int, ...] = ()
    nbytes: int = 0  # bytes the node allocates (0 for views, getitem, symbols)
    alias: int = -1  # the node whose storage this one shares, or -1
    cost: float = 0.0  # work to recompute it (FLOPs for matmuls, convolutions and attention; output elements otherwise)
    clonable: bool = True  # functional and safe to run twice (no mutation, collective, *_backward)
    resident: bool = False  # an input that is live anyway (parameter, user input): costs nothing
    layer: str = ""  # the model layer it belongs to ("layers.3"), when known


@dataclass(slots=True)
class Walk:
    """Result of walking a program: its peak and where it happens."""

    peak: int
    peak_at: int  # position in the program (-1: at the start)
    area: int  # sum of live bytes over steps (a tie-breaker: less is better)
    start: int  # bytes live before the first step
    live_at_peak: list[int] = field(default_factory=list)  # storage roots (node indices) live at the peak
    last_use: dict[int, int] = field(default_factory=dict)  # storage root -> last position it is needed


def _sinks(nodes: Sequence[Node], order: Sequence[int], present: set[int], keep: set[int]) -> dict[int, int]:
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


def _last_uses(nodes: Sequence[Node], order: Sequence[int], present: set[int], pos: dict[int, int],
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


def walk(nodes: Sequence[Node], order: Sequence[int], start: Iterable[int] = (), keep: Iterable[int] = (),
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
    sink = _sinks(nodes, order, present, keep_set) if fuse else {}

    def root(j: int) -> int:
        a = nodes[j].alias
        while a >= 0 and a in present:
            j, a = a, nodes[a].alias
        return j

    roots = {j: root(j) for j in present}
    last = _last_uses(nodes, order, present, pos, sink, roots)
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

