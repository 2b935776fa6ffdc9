"""networkx's `minimum_cut` for the min-cut partitioner's flow networks, solved by memprof's native
max-flow (Dinic's, in C++): the same partition, many times faster than networkx's Python max-flow
on a deep model's joint graph (docs/benchmarks.md, session 23).

The partition is the one networkx returns whatever max-flow it runs: the sink side is every node
that can still reach the sink in the residual network, which is the same set for every maximum flow.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from memprof._native import native
from memprof.errors import NativeUnavailable


def minimum_cut(graph: Any, s: Any, t: Any, capacity: str = "capacity") -> tuple[float, tuple[set[Any], set[Any]]]:
    """`networkx.minimum_cut(graph, s, t)` of a directed graph: (cut value, (source side, sink side)).
    An edge without `capacity` has an infinite one, as in networkx. Raises ValueError where the
    native solver cannot answer it (an undirected or multi-graph, a negative capacity, no finite
    cut): the caller then asks networkx, which says what is wrong."""
    if not graph.is_directed() or graph.is_multigraph():
        raise ValueError("a directed graph without parallel edges is cut natively")
    nodes = list(graph)
    index = {node: i for i, node in enumerate(nodes)}
    if s not in index or t not in index:
        raise ValueError("the source or the sink is not in the graph")
    m = graph.number_of_edges()
    src = np.empty(m, dtype=np.int64)
    dst = np.empty(m, dtype=np.int64)
    cap = np.empty(m, dtype=np.float64)
    k = 0
    for u, nbrs in graph.adjacency():
        i = index[u]
        for v, data in nbrs.items():
            src[k], dst[k] = i, index[v]
            cap[k] = data.get(capacity, math.inf)
            k += 1
    try:
        solver = native()
    except NativeUnavailable as exc:
        raise ValueError(str(exc)) from None
    value, sink = solver.min_cut(src, dst, cap, len(nodes), index[s], index[t])
    sink_side = {nodes[i] for i in np.flatnonzero(sink).tolist()}
    return float(value), ({n for n in nodes if n not in sink_side}, sink_side)
