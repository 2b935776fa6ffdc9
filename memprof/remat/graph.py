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

import numpy as np

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


@dataclass(frozen=True)
class NodeArrays:
    """A graph's nodes as arrays, for `walk`: build it once for a graph walked many times (the
    saved-set choice walks one joint graph hundreds of times)."""

    nbytes: np.ndarray  # int64
    alias: np.ndarray  # int64, -1: none
    resident: np.ndarray  # bool
    fusible: np.ndarray  # bool: a pointwise node that allocates (fused into a single fusible consumer)
    consumer: np.ndarray  # bool: a kind that pointwise producers fuse into
    indptr: np.ndarray  # int64: node j's inputs are indices[indptr[j]:indptr[j + 1]]
    indices: np.ndarray  # int64

    @classmethod
    def of(cls, nodes: Sequence[Node]) -> NodeArrays:
        kinds = [nd.kind for nd in nodes]
        nbytes = np.fromiter((nd.nbytes for nd in nodes), np.int64, len(nodes))
        degree = np.fromiter((len(nd.inputs) for nd in nodes), np.int64, len(nodes))
        return cls(nbytes, np.fromiter((nd.alias for nd in nodes), np.int64, len(nodes)),
                   np.fromiter((nd.resident for nd in nodes), bool, len(nodes)),
                   np.array([k == POINTWISE for k in kinds], dtype=bool) & (nbytes > 0),
                   np.array([k in _FUSIBLE_CONSUMER for k in kinds], dtype=bool),
                   np.concatenate(([0], np.cumsum(degree))),
                   np.fromiter((k for nd in nodes for k in nd.inputs), np.int64, int(degree.sum())))

    def __len__(self) -> int:
        return len(self.nbytes)


def _follow(step: np.ndarray) -> np.ndarray:
    """Where each index ends following `step` (a forest of chains: step[j] == j at each end)."""
    while True:
        nxt = step[step]
        if np.array_equal(nxt, step):
            return step
        step = nxt


def _sinks(g: NodeArrays, order: np.ndarray, cons: np.ndarray, inp: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Fused pointwise nodes allocate nothing; their uses happen at their consumer (the "sink"):
    per node, the sink it is fused into, or -1. `cons`, `inp`: the program's reads (consumer, input)."""
    n = len(g)
    uses = np.bincount(inp, minlength=n)
    user = np.full(n, -1, dtype=np.int64)
    user[inp] = cons  # (the only one where uses == 1)
    fused = np.zeros(n, dtype=bool)
    fused[order] = True
    fused &= g.fusible & (uses == 1)
    fused[keep] = False
    fused[fused] = g.consumer[user[fused]]
    step = np.arange(n)
    step[fused] = user[fused]
    return np.where(fused, _follow(step), -1)


def walk(nodes: Sequence[Node] | NodeArrays, order: Sequence[int], start: Iterable[int] = (),
         keep: Iterable[int] = (), fuse: bool = True, detail: bool = True) -> Walk:
    """Estimate the peak of running `order` with `start` live at entry and `keep` live at exit.

    `order` lists node indices to execute; inputs of executed nodes must be in `start` or
    executed earlier (or be resident). Positions in the result refer to `order`. `nodes` may be
    given as their `NodeArrays` (a graph walked many times).
    """
    g = nodes if isinstance(nodes, NodeArrays) else NodeArrays.of(nodes)
    n = len(g)
    seq = np.asarray(order, dtype=np.int64).reshape(-1)
    n_steps = len(seq)
    begin = np.unique(np.fromiter(start, np.int64))
    kept = np.unique(np.fromiter(keep, np.int64))
    present = np.zeros(n, dtype=bool)
    present[begin] = True
    present[seq] = True
    pos = np.full(n, -1, dtype=np.int64)
    pos[seq] = np.arange(n_steps)
    # every read by an executed node of a value in the program: (consumer, input)
    degree = g.indptr[seq + 1] - g.indptr[seq]
    cons = np.repeat(seq, degree)
    inp = g.indices[np.repeat(g.indptr[seq] - np.cumsum(degree) + degree, degree) + np.arange(int(degree.sum()))]
    read = present[inp]
    cons, inp = cons[read], inp[read]
    sink = _sinks(g, seq, cons, inp, kept) if fuse else np.full(n, -1, dtype=np.int64)

    step = np.arange(n)  # a view's storage is its base's, where the base is in the program
    shares = g.alias >= 0
    shares[shares] = present[g.alias[shares]]
    step[shares] = g.alias[shares]
    roots = _follow(step)

    last = np.full(n, -2, dtype=np.int64)  # storage root -> the last position that reads it (-2: none)
    np.maximum.at(last, roots[inp], pos[np.where(sink[cons] >= 0, sink[cons], cons)])
    kept = kept[present[kept]]
    last[roots[kept]] = n_steps
    owners = begin[(roots[begin] == begin) & ~g.resident[begin]]
    start_bytes = int(g.nbytes[owners].sum())
    owners = owners[g.nbytes[owners] != 0]
    owner_end = np.maximum(last[owners], -1)  # freed after that position; -1: at once
    live = start_bytes - int(g.nbytes[owners[owner_end < 0]].sum())

    allocs = (g.nbytes[seq] != 0) & (roots[seq] == seq) & (sink[seq] < 0) & ~g.resident[seq]
    at = np.flatnonzero(allocs)
    made = seq[at]
    end = np.maximum(np.where(last[made] == -2, at, last[made]), at)
    grow = np.zeros(n_steps, dtype=np.int64)
    grow[at] = g.nbytes[made]
    freed = np.zeros(n_steps + 1, dtype=np.int64)  # freed after each position (n_steps: never)
    np.add.at(freed, np.minimum(end, n_steps), g.nbytes[made])
    going = owner_end >= 0
    np.add.at(freed, np.minimum(owner_end[going], n_steps), g.nbytes[owners[going]])
    levels = live + np.cumsum(grow) - np.concatenate(([0], np.cumsum(freed[:n_steps - 1])))[:n_steps]
    peak, peak_at = live, -1
    if n_steps and int(levels.max()) > live:
        peak_at = int(np.argmax(levels))
        peak = int(levels[peak_at])
    at_peak: list[int] = []
    last_use: dict[int, int] = {}
    if detail:
        first = max(peak_at, 0)
        span_root = np.concatenate((owners, made))
        span_from = np.concatenate((np.full(len(owners), -1, dtype=np.int64), at))
        span_to = np.concatenate((owner_end, end))
        hit = (span_from <= peak_at) & (span_to >= first) & ~((peak_at < 0) & (span_to < 0))
        at_peak = sorted(set(span_root[hit].tolist()))
        used = np.flatnonzero(last != -2)
        last_use = dict(zip(used.tolist(), last[used].tolist(), strict=True))
    return Walk(peak, peak_at, int(levels.sum()) if n_steps else 0, start_bytes, at_peak, last_use)
