"""Inside the min-cut partitioner, for the remat pass: its saved-set choice replaced for one
partitioner call, the knapsack's repeated work memoized, and its minimum cuts solved by another
solver."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from memprof.torch_hooks.patch import Patches

# (the stock choice, joint graph, node info, the stock saved set, budget) -> the saved set to use
Choice = Callable[[Callable[..., list[Any]], Any, Any, list[Any], float], list[Any]]
# (networkx graph, source, sink, capacity attribute) -> networkx.minimum_cut's answer, or ValueError
MinCut = Callable[[Any, Any, Any, str], tuple[float, tuple[set[Any], set[Any]]]]


@contextlib.contextmanager
def saved_set_choice(choose: Choice, min_cut: MinCut | None = None) -> Iterator[None]:
    """Within: the partitioner's `choose_saved_values_set` returns `choose(stock_choice, joint_graph,
    node_info, stock_saved_set, budget)`. The knapsack at every budget starts from the same
    three min-cuts and prices the same candidates, so `solve_min_cut` and `estimate_runtime`
    are memoized for the block (`stock_choice` at other budgets reuses them). `min_cut` answers
    the partitioner's `networkx.minimum_cut` calls (networkx itself where it raises ValueError)."""
    import networkx as nx  # type: ignore[import-untyped]
    import torch._functorch.partitioners as P

    original = P.choose_saved_values_set
    original_cut = nx.minimum_cut
    original_min_cut = P.solve_min_cut
    original_runtime = P.estimate_runtime
    memo: dict[tuple[int, str, frozenset[Any]], tuple[list[Any], Any]] = {}
    runtimes: dict[Any, float] = {}

    def estimate_runtime(node: Any) -> float:
        if node not in runtimes:  # a FLOP count under fake tensors
            runtimes[node] = original_runtime(node)
        return runtimes[node]

    def solve_min_cut(joint_graph: Any, node_info: Any, options: Any, dont_ban: Any = None) -> Any:
        key = (id(joint_graph), repr(options), frozenset(dont_ban or ()))
        if key not in memo:
            memo[key] = original_min_cut(joint_graph, node_info, options, dont_ban)
        saved, banned = memo[key]
        return list(saved), type(banned)(banned)

    def choose_saved_values_set(joint_graph: Any, node_info: Any, *args: Any, **kwargs: Any) -> Any:
        stock = original(joint_graph, node_info, *args, **kwargs)
        budget = float(kwargs.get("memory_budget", args[0] if args else 1.0))
        return choose(original, joint_graph, node_info, stock, budget)

    def minimum_cut(graph: Any, s: Any, t: Any, capacity: str = "capacity", **kwargs: Any) -> Any:
        if min_cut is not None and not kwargs:  # (a flow_func or residual asked for: networkx's own)
            try:
                return min_cut(graph, s, t, capacity)
            except ValueError:
                pass
        return original_cut(graph, s, t, capacity=capacity, **kwargs)

    with Patches() as patches:
        patches.set("torch._functorch.partitioners", "choose_saved_values_set", choose_saved_values_set)
        patches.set("networkx", "minimum_cut", minimum_cut)
        patches.set("torch._functorch.partitioners", "solve_min_cut", solve_min_cut)
        patches.set("torch._functorch.partitioners", "estimate_runtime", estimate_runtime)
        yield
