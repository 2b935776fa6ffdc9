"""memprof's native minimum cut (`memprof.remat.flow`) returns what networkx's `minimum_cut` returns:
the same cut value and the same partition, on random flow networks and on the min-cut
partitioner's own network of a real joint graph."""

from __future__ import annotations

import math
from typing import Any

import networkx as nx  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memprof.remat.flow import minimum_cut

CAPACITIES = st.one_of(st.integers(0, 20).map(float), st.just(math.inf), st.none())  # None: no capacity


@st.composite
def networks(draw: Any) -> nx.DiGraph:
    n = draw(st.integers(2, 12))
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for u, v in draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=40)):
        if u != v:
            cap = draw(CAPACITIES)
            g.add_edge(u, v, **({} if cap is None else {"capacity": cap}))
    return g


@settings(max_examples=300, deadline=None)
@given(networks())
def test_the_native_cut_is_networkx_s_cut(g: nx.DiGraph) -> None:
    s, t = 0, len(g) - 1
    try:
        expected = nx.minimum_cut(g, s, t)
    except nx.NetworkXUnbounded:  # a path of infinite capacity: no finite cut, said as a ValueError
        with pytest.raises(ValueError, match="infinite capacity"):
            minimum_cut(g, s, t)
        return
    assert minimum_cut(g, s, t) == expected


def test_graphs_it_does_not_cut_are_refused() -> None:
    with pytest.raises(ValueError):
        minimum_cut(nx.Graph([(0, 1)]), 0, 1)
    with pytest.raises(ValueError):
        minimum_cut(nx.MultiDiGraph([(0, 1), (0, 1)]), 0, 1)
    with pytest.raises(ValueError):
        minimum_cut(nx.DiGraph([(0, 1)]), 0, 2)
    g = nx.DiGraph()
    g.add_edge(0, 1, capacity=-1.0)
    with pytest.raises(ValueError, match="negative"):
        minimum_cut(g, 0, 1)


def test_the_partitioner_s_own_networks_cut_the_same() -> None:
    """Every network torch's min-cut partitioner builds for a four-layer Llama-style model at budget
    0.1 (the knapsack's cuts included): networkx's partition, to the node."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from tests.remat_models import TinyLlama, projection_loss

    seen: list[tuple[Any, Any]] = []
    original = nx.minimum_cut

    def both(graph: nx.DiGraph, s: Any, t: Any, **kwargs: Any) -> Any:
        out = original(graph, s, t, **kwargs)
        seen.append((out, minimum_cut(graph, s, t)))
        return out

    torch.manual_seed(0)
    model, batch = TinyLlama(), torch.randint(0, 128, (2, 32))

    def nop(gm: Any, _: Any) -> Any:
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=0.1), pytest.MonkeyPatch.context() as mp:
        mp.setattr(nx, "minimum_cut", both)
        torch.compile(lambda m, x: projection_loss(m(x)), backend=backend)(model, batch)
    torch._dynamo.reset()
    assert len(seen) >= 2  # the knapsack's cuts and the final one
    for expected, native in seen:
        assert native == expected
