"""Recording compile plans: what torch.compile decided for each graph compiled while it runs.

`PlanRecorder` observes the partitioner chain (`memprof.torch_hooks.partition`) and Inductor's
code generation (`memprof.torch_hooks.inductor`). For each forward/backward pair it records both
FX graphs, the saved values, the recomputed nodes, the random ops and the budget; for each compiled
graph its wrapper source, the FX nodes behind every buffer and a unique key, so that its runtime
`## Call CompiledFxGraph <key> ##` scope can be joined to it; and which tensors are parameters,
gradients and optimizer state (`tensors`). It never changes a partition and never fails the user's
compile: an internal error is recorded as a note.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from memprof.errors import one_line
from memprof.graph_store import GraphRecord, GraphStore, PairRecord
from memprof.plans import CompiledGraph, FxGraph, FxNode, Plan, RecomputedNode
from memprof.torch_hooks import inductor, partition
from memprof.torch_hooks.fx import (
    call_spec,
    is_random_node,
    is_random_valued,
    item_sizes,
    node_module_path,
    probed,
    value_info,
)
from memprof.torch_hooks.known_tensors import KnownTensorRecorder
from memprof.torch_hooks.patch import Patches

_counter = itertools.count()


def _is_mask(node: Any, random: set[str]) -> bool:
    """A boolean value within three steps of a random op: a comparison of (a view of) random values."""
    frontier, seen = list(node.all_input_nodes), 0
    for _ in range(3):
        if any(f.name in random for f in frontier):
            return True
        frontier = [i for f in frontier for i in f.all_input_nodes]
        seen += len(frontier)
        if seen > 64:
            return False
    return False


def fx_graph(gm: Any) -> FxGraph:
    """Plain-data copy of a GraphModule's nodes (taken before Inductor's passes mutate it)."""
    random = {n.name for n in gm.graph.nodes if is_random_node(n)}
    random_valued = {n.name for n in gm.graph.nodes if is_random_valued(n)}  # what a mask compares
    # ops Inductor will run as fallback kernels (their scratch memory is invisible in its wrapper)
    lowering = sys.modules.get("torch._inductor.lowering")
    fallbacks = getattr(lowering, "fallbacks", ())
    nodes: list[FxNode] = []
    for n in gm.graph.nodes:
        shape, dtype, nbytes, size_expr = value_info(n.meta.get("val"))
        sources = n.meta.get("from_node") or []
        nodes.append(FxNode(
            name=n.name, op=n.op, target=str(n.target) if n.op != "placeholder" else "",
            shape=shape, dtype=dtype, bytes=nbytes, size_expr=size_expr, users=[u.name for u in n.users],
            module_path=node_module_path(n), source=str(getattr(sources[0], "name", "")) if sources else "",
            random=n.name in random,
            # a dropout mask, or the random numbers it compares (a value made from a seed: its category)
            mask=n.op == "call_function" and ((dtype == "bool" and _is_mask(n, random_valued))
                                              or (n.name in random_valued and n.name not in random)),
            call=call_spec(n) if probed(n, fallbacks) else "",
            items=item_sizes(n.meta.get("val")) if n.op == "call_function" else [],
        ))
    return FxGraph(nodes)


def build_plan(index: int, backend: str, partitioner: str, budget: float, num_fwd_outputs: int,
               fw: Any, bw: Any, remat: dict[str, Any] | None = None, knapsack_peak: float | None = None) -> Plan:
    """Describe a partition: saved values, recomputed nodes and where the backward uses them."""
    fwg, bwg = fx_graph(fw), fx_graph(bw)
    out = next(n for n in fw.graph.nodes if n.op == "output")
    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    saved = [str(getattr(a, "name", a)) for a in outs[num_fwd_outputs:]]
    fw_calls = {n.name for n in fwg.nodes if n.op == "call_function"}
    bw_index = bwg.index
    recomputed: list[RecomputedNode] = []
    for i, n in enumerate(bwg.nodes):
        if n.op == "call_function" and n.name in fw_calls:
            uses = [bw_index[u] for u in n.users if u in bw_index]
            recomputed.append(RecomputedNode(n.name, i, min(uses, default=i), max(uses, default=i),
                                             fwg.by_name[n.name].bytes))
    random_ops = [n.name for n in fwg.nodes if n.random]
    rec_names = {r.name for r in recomputed}
    masks = [n.name for n in fwg.nodes if n.mask and (n.name in saved or n.name in rec_names)]
    return Plan(
        index=index, backend=backend, partitioner=partitioner, budget=budget, num_fwd_outputs=num_fwd_outputs,
        forward=fwg, backward=bwg, saved=saved, recomputed=[r.name for r in recomputed],
        recompute_sites=recomputed, random_ops=random_ops, recomputed_random=[n for n in random_ops if n in rec_names],
        masks=masks, remat=remat, knapsack_peak=knapsack_peak,
    )


def resolve_budget(joint: Any) -> float:
    """The budget the partitioner applies: the config value, unless a node carries its own."""
    from memprof.torch_hooks.budget import current_budget

    for n in joint.graph.nodes:
        b = n.meta.get("memory_budget")
        if isinstance(b, float):
            return b
    return current_budget()


def _graph_notes(kwargs: dict[str, Any]) -> list[str]:
    """What keeps a compiled graph's wrapper from being joined buffer by buffer."""
    import torch._inductor.config as inductor_config

    notes: list[str] = []
    if kwargs.get("cpp_wrapper"):
        notes.append("cpp_wrapper")
    cudagraphs = kwargs.get("cudagraphs")
    if cudagraphs is not None and bool(getattr(cudagraphs, "value", cudagraphs)):
        notes.append("CUDA graphs")
    if inductor_config.memory_planning:
        notes.append("memory planning")
    return notes


class PlanRecorder(KnownTensorRecorder):
    """The compile hooks of one capture (or prediction) and what they see (the known tensors:
    `KnownTensorRecorder`)."""

    def __init__(self, now_ns: Callable[[], int], note: Callable[[str], None],
                 knapsack_evaluator: bool = False, fx_cache: bool = False) -> None:
        # `fx_cache`: AOTAutograd's and Inductor's FX graph caches stay on (memprof's own entries,
        # `partition.observing`) and `store` keeps what a hit skips, beside Inductor's cache; otherwise
        # both are off while recording
        self.fx_cache = fx_cache
        self.store: GraphStore | None = None
        self.note = note
        self.knapsack_evaluator = knapsack_evaluator  # run KnapsackEvaluator on each knapsack plan
        self.plans: list[Plan] = []
        self.graphs: list[CompiledGraph] = []
        KnownTensorRecorder.__init__(self, now_ns)
        self.active = False
        self.installed = False  # the hooks went in (memprof installs them at the first torch.compile)
        self._graph_plan: dict[int, int] = {}
        self._local = threading.local()
        self._hooks = contextlib.ExitStack()
        self._errors: set[str] = set()

    # -- install / uninstall ------------------------------------------------------------
    def install(self) -> None:
        self.active = self.installed = True
        if self.fx_cache and self.store is None:
            try:
                self.store = GraphStore(inductor.cache_root() / "memprof")
            except Exception as exc:  # no cache directory: recorded with the compile caches off
                self.error(f"no store beside Inductor's cache ({one_line(exc)}); the compile caches are off")
        patches = self._hooks.enter_context(Patches())
        if self.knapsack_evaluator:
            try:
                inductor.install_knapsack_hook(patches, self._on_knapsack)
            except Exception as exc:
                self.error(f"knapsack hook unavailable ({one_line(exc)}); no KnapsackEvaluator peaks")
        try:
            inductor.install_graph_hooks(patches, self)
        except Exception as exc:  # an unexpected torch version: capture without plans
            self.error(f"Inductor hooks unavailable ({one_line(exc)}); no compile plans")
        try:
            self._hooks.enter_context(partition.observing(self, keeper=self if self.store is not None else None))
        except Exception as exc:
            self.error(f"partitioner hook unavailable ({one_line(exc)}); no compile plans")

    def uninstall(self) -> None:
        self.active = False
        self._hooks.close()

    def error(self, text: str) -> None:
        if text not in self._errors:
            self._errors.add(text)
            self.note(text)

    # -- the partitioner chain (partition.PartitionObserver) ----------------------------
    def _on_knapsack(self, call: inductor.KnapsackCall) -> None:
        calls = getattr(self._local, "knapsack", None)
        if calls is not None:  # kept for the plan; evaluated once the partition is done
            calls.append(call)

    def partition_started(self, joint: Any) -> float | None:
        self._local.knapsack = []
        try:
            return resolve_budget(joint)
        except Exception as exc:
            self.error(f"budget not resolved ({one_line(exc)})")
            return None

    def partition_done(self, budget: float | None, fn: Any, backend: str, kwargs: dict[str, Any],
                       result: tuple[Any, Any] | None) -> None:
        calls, self._local.knapsack = self._local.knapsack, None
        if not self.active or result is None:
            return
        fw, bw = result
        knapsack_peak: float | None = None
        call = next((c for c in calls if budget is not None and abs(c[0] - budget) < 1e-9), None)
        if call is not None:
            try:
                knapsack_peak = inductor.knapsack_evaluator_peak(call)
            except Exception as exc:
                self.error(f"KnapsackEvaluator failed ({one_line(exc)})")
        try:
            index = len(self.plans)
            report = getattr(bw, "meta", {}).get("memprof_remat")
            self.plans.append(build_plan(index, backend, getattr(fn, "__name__", type(fn).__name__),
                                         budget if budget is not None else float("nan"),
                                         int(kwargs.get("num_fwd_outputs", 0)), fw, bw,
                                         report.to_json() if report is not None else None, knapsack_peak))
            self._local.last_plan = index
            self.record_modules()
        except Exception as exc:
            self.error(f"a compile plan was not recorded ({one_line(exc)})")

    # -- AOTAutograd's cache (partition.RecordKeeper) -------------------------------------
    def cache_saved(self, key: str, graphs: partition.GraphKeys) -> None:
        """Keep the pair AOTAutograd saved: its plan and compiled graphs, as recorded at its compile."""
        fw_key, bw_key = graphs
        first = next((g for g in reversed(self.graphs) if g.key == fw_key and g.role != "backward"), None)
        second = next((g for g in reversed(self.graphs) if g.key == bw_key and g.role == "backward"), None)
        if self.store is None or first is None or (bw_key is not None and second is None):
            return  # not seen compiled here: a later hit on `key` is compiled again
        plan = next((p for p in self.plans if p.index == first.plan), None)
        try:
            self.store.put_pair(key, PairRecord(plan, [first] + ([second] if second is not None else [])))
        except Exception as exc:
            self.error(f"a compiled pair was not kept for AOTAutograd's cache ({one_line(exc)})")

    def cache_hit(self, key: str, graphs: partition.GraphKeys) -> Callable[[], None] | None:
        """AOTAutograd found `key`: record the pair from memprof's record of it, if it matches."""
        record = self.store.get_pair(key) if self.store is not None else None
        if record is None or [g.key for g in record.graphs] != [k for k in graphs if k is not None]:
            return None

        def replay() -> None:  # (runs inside torch's compile: never raises)
            try:
                index: int | None = None
                if record.plan is not None:
                    index = len(self.plans)
                    self.plans.append(dataclasses.replace(record.plan, index=index))
                    self.record_modules()
                self.graphs.extend(dataclasses.replace(g, plan=index, graph_id=None) for g in record.graphs)
            except Exception as exc:
                self.error(f"a pair from AOTAutograd's cache was not recorded ({one_line(exc)})")

        return replay

    def graph_hit(self, key: str) -> bool:
        return self.store is not None and self.store.get(key) is not None

    # -- Inductor (inductor.GraphSink) --------------------------------------------------
    def graph_compiled(self, result: Any, kwargs: dict[str, Any], origins: list[dict[str, list[str]]],
                       estimates: list[tuple[int, int | None]]) -> None:
        source = getattr(result, "source_code", None)
        if not hasattr(result, "_fx_graph_cache_key") or not isinstance(source, str):
            self.error(f"a compiled graph of type {type(result).__name__} has no Python wrapper; "
                       "its allocations are attributed at kernel level")
            return
        key = result._fx_graph_cache_key
        if not key:
            key = f"memprof-{os.getpid()}-{next(_counter)}"
            result._fx_graph_cache_key = key  # only names the graph's profiler scope
        elif self.store is not None:  # Inductor's FX graph cache is on: a hit skipped code generation
            if origins:
                self.store.put(key, GraphRecord(origins[-1], min((a for a, _k in estimates), default=None),
                                                min((k for _a, k in estimates if k is not None), default=None)))
            else:
                stored = self.store.get(str(key))
                if stored is None:
                    self.error(f"a graph came from Inductor's cache without memprof's record of its buffers "
                               f"(key {key}); it is attributed at kernel level (a trace with an empty "
                               "TORCHINDUCTOR_CACHE_DIR records it again)")
                else:
                    origins = [stored.origins]
                    estimates = [(stored.estimate, stored.estimate_kept)] if stored.estimate is not None else []
        role = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        graph_id = kwargs.get("graph_id")
        plan: int | None = None
        if role == "forward":
            plan = getattr(self._local, "last_plan", None)
            self._local.last_plan = None
            if plan is not None and graph_id is not None:
                self._graph_plan[int(graph_id)] = plan
        elif role == "backward" and graph_id is not None:
            plan = self._graph_plan.get(int(graph_id))
        as_is = [a for a, _k in estimates]
        kept = [k for _a, k in estimates if k is not None]
        self.graphs.append(CompiledGraph(key=str(key), role=role, plan=plan,
                                         graph_id=None if graph_id is None else int(graph_id),
                                         origins=origins[-1] if origins else {}, source=source,
                                         notes=_graph_notes(kwargs),
                                         inductor_estimate=min(as_is) if as_is else None,
                                         inductor_estimate_kept=min(kept) if kept else None))
