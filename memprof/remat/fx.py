"""The FX side of the remat pass: graphs to plain lists, the partitioner hook, the rewrite.

`partition(fn, gm, joint_inputs, mode, **kwargs)` runs a partitioner (`fn`, normally
`min_cut_rematerialization_partition`) with memprof's saved-set choice in place of the stock
one, then rewrites the backward with use-site rematerialization. Any failure falls back to the
stock partition and says so in the report; random ops are counted before and after and the
result is refused if the backward gained one.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import threading
import time
from collections.abc import Callable
from typing import Any

from memprof.errors import one_line
from memprof.plans import layer_of
from memprof.remat.flow import minimum_cut
from memprof.remat.graph import (
    ATTENTION,
    HEAVY,
    INPUT,
    ITEM,
    OTHER,
    OUTPUT,
    POINTWISE,
    RANDOM,
    REDUCTION,
    VIEW,
    Node,
    walk,
)
from memprof.remat.report import RematReport
from memprof.remat.saves import Joint, choose_saves, preferred, recompute_limit, step_work
from memprof.remat.usesite import Program, rematerialize
from memprof.torch_hooks.fx import (
    is_random_node,
    is_view,
    mutates,
    node_module_path,
    numel,
    op_flops,
    op_name,
    size_hint,
    tensor_bytes,
)
from memprof.torch_hooks.partitioner import saved_set_choice

_HEAVY = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "convolution", "_convolution",
          "_scaled_mm", "matmul", "linear"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var_mean", "var", "std", "std_mean", "prod",
               "argmax", "argmin", "any", "all", "logsumexp", "_softmax", "_log_softmax", "norm",
               "linalg_vector_norm", "native_layer_norm", "native_group_norm", "cumsum"}
_ATTENTION_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "flex_attention")
_COLLECTIVE_PREFIXES = ("_c10d_functional", "c10d", "_dtensor", "c10d_functional")
_reports: list[RematReport] = []
_reports_lock = threading.Lock()


# kernels whose Inductor lowering (`sdpa_constraint`) copies an attention bias dense unless it is a
# realized, aligned tensor: an expanded view of a mask computed in the same graph becomes
# B x H x L x L (argument 4 of both ops)
_DENSE_BIAS_OPS = {"_scaled_dot_product_efficient_attention_backward", "_efficient_attention_backward"}


def bias_bases(fx_nodes: list[Any], index: dict[Any, int]) -> list[int]:
    """Indices of the values under the attention biases of `_DENSE_BIAS_OPS` calls (through views)."""
    out: set[int] = set()
    for n in fx_nodes:
        if n.op != "call_function" or op_name(n.target) not in _DENSE_BIAS_OPS or len(n.args) < 5:
            continue
        bias, through_view = n.args[4], False
        while hasattr(bias, "target") and is_view(bias.target) and bias.args:
            bias, through_view = bias.args[0], True
        if through_view and bias in index:
            out.add(index[bias])
    return sorted(out)


def to_node(n: Any, index: dict[Any, int], random: Callable[[Any], bool]) -> Node:
    """Plain-data description of one FX node (indices via `index`)."""
    import torch

    inputs = tuple(index[i] for i in n.all_input_nodes if i in index)
    val = n.meta.get("val")
    layer = layer_of(node_module_path(n))
    if n.op in ("placeholder", "get_attr"):
        return Node(n.name, INPUT, (), tensor_bytes(val), layer=layer)
    if n.op == "output":
        return Node(n.name, OUTPUT, inputs, clonable=False)
    target = n.target
    if target is operator.getitem:  # an output of a multi-output op: it owns its storage
        return Node(n.name, ITEM, inputs, tensor_bytes(val), -1, 0.0, True, False, layer)
    name = op_name(target)
    nbytes = tensor_bytes(val)
    if isinstance(val, (list, tuple)):  # the outputs are counted at their getitems (unused ones: here)
        used = {u.args[1] for u in n.users if u.target is operator.getitem and len(u.args) > 1}
        nbytes = sum(tensor_bytes(v) for i, v in enumerate(val) if i not in used)
    n_elements = float(numel(val))
    is_op = isinstance(target, torch._ops.OpOverload)
    functional = is_op and not mutates(target)
    tstr = str(target)
    forbidden = (not functional or "backward" in name or name.endswith("_")
                 or tstr.startswith(_COLLECTIVE_PREFIXES) or name.startswith(_COLLECTIVE_PREFIXES))
    if random(n):
        return Node(n.name, RANDOM, inputs, nbytes, -1, n_elements, False, False, layer)
    if forbidden:  # never recomputed; its cost counts in the step's work (attention's and convolutions' backward)
        flops = op_flops(n)
        return Node(n.name, OTHER, inputs, nbytes, -1, n_elements if flops is None else flops, False, False, layer)
    if any(w in name for w in _ATTENTION_WORDS):  # matmul-class work: costed in FLOPs, as matmuls are
        flops = op_flops(n)
        return Node(n.name, ATTENTION, inputs, nbytes, -1, n_elements if flops is None else flops, False, False, layer)
    if is_view(target):
        base = next((i for i in n.all_input_nodes if i in index), None)
        return Node(n.name, VIEW, inputs, 0, index[base] if base is not None else -1, 0.0, True, False, layer)
    if name in _HEAVY:
        flops = op_flops(n)
        if flops is not None:
            return Node(n.name, HEAVY, inputs, nbytes, -1, flops, True, False, layer)
        k = 1
        mats = [a for a in n.args if hasattr(a, "meta")]
        if len(mats) >= 2:
            a = mats[-2].meta.get("val")
            try:
                k = size_hint(a.shape[-1]) or 1
            except Exception:
                k = 1
        return Node(n.name, HEAVY, inputs, nbytes, -1, 2.0 * n_elements * k, True, False, layer)
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return Node(n.name, POINTWISE, inputs, nbytes, -1, n_elements, True, False, layer)
    if name in _REDUCTIONS:
        return Node(n.name, REDUCTION, inputs, nbytes, -1, n_elements, True, False, layer)
    return Node(n.name, OTHER, inputs, nbytes, -1, n_elements, False, False, layer)


def joint_model(joint_graph: Any, node_info: Any, num_fwd_outputs: int) -> tuple[Joint, list[Any]]:
    """The joint graph as plain lists, plus the FX nodes by index."""
    fx_nodes = list(joint_graph.nodes)
    index = {n: i for i, n in enumerate(fx_nodes)}
    nodes = [to_node(n, index, is_random_node) for n in fx_nodes]
    inputs = set(node_info.inputs)
    for n in node_info.inputs:
        nodes[index[n]].resident = True
    claimed = set(node_info.required_fw_nodes) | set(node_info.unclaimed_nodes)  # (lists in torch 2.11)
    forward = [n in claimed for n in fx_nodes]
    primals = [index[n] for n in node_info.inputs]
    tangents = [i for i, n in enumerate(fx_nodes) if n.op == "placeholder" and n not in inputs]
    out = next(n for n in reversed(fx_nodes) if n.op == "output")
    outs = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    fw_outs = [index[o] for o in outs[:num_fwd_outputs] if o in index]
    bw_outs = [index[o] for o in outs[num_fwd_outputs:] if o in index]
    return Joint(nodes, forward, primals, tangents, fw_outs, bw_outs), fx_nodes


def bw_program(gm: Any) -> tuple[Program, list[Any]]:
    fx_nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(fx_nodes)}
    nodes = [to_node(n, index, is_random_node) for n in fx_nodes]
    start = [i for i, n in enumerate(fx_nodes) if n.op == "placeholder"]
    for i in start:
        if fx_nodes[i].name.startswith("primals"):
            nodes[i].resident = True
    out = next(i for i, n in enumerate(fx_nodes) if n.op == "output")
    order = [i for i, n in enumerate(fx_nodes) if n.op not in ("placeholder", "output")]
    return Program(nodes, order, start, list(nodes[out].inputs)), fx_nodes


def random_count(gm: Any) -> int:
    return sum(1 for n in gm.graph.nodes if is_random_node(n))


# budgets around the requested one whose stock saved sets the pass also starts from, in this order
# (it keeps the candidate with the lowest estimated peak that `saves.preferred` allows: no more
# recomputation than the stock plan, or a little more for a clearly lower peak; ties go to less
# recomputation, then to the first tried): a larger budget's knapsack can pick a set that splits
# the layers better, so a smaller budget need not end higher than a nearby larger one; a smaller
# budget's set (a fraction of the requested one) can hold far less for nearly the same work (the
# bf16 GQA decoder at 0.10 and batch 16: from 5,292 to 4,873 MB, under per-layer checkpointing, from
# budget 0.05's set, at 0.98x stock's GPU time). All steps run unless one takes unusually long
# (`_SaveHook.decide`): a plan does not depend on the machine's speed. Each costs a stock knapsack
# (docs/benchmarks.md, "Figures behind design choices", "Sessions 14, 16, 18"; 0.75: the paper BERT's).
LADDER = (0.01, 0.02)
LADDER_DOWN = (0.75, 0.5, 0.25)  # fractions of the requested budget
# Where a rung's set recomputes past the allowance and the rung above it does not, the ladder halves
# the gap between them this many times: a budget between two rungs can hold less than the upper
# one's for less recomputation than the lower one's (the paper BERT at 0.10, batch 2, CPU: 329.0 ->
# 296.0 MB, per-layer checkpointing 294.6; docs/benchmarks.md, "Session 22")
BISECTIONS = 2


class _SaveHook:
    """Replaces `choose_saved_values_set` for one partitioner call."""

    def __init__(self, report: RematReport, num_fwd_outputs: int, time_limit: float,
                 ladder: tuple[float, ...] | None = None, down: tuple[float, ...] | None = None) -> None:
        self.report = report
        self.num_fwd_outputs = num_fwd_outputs
        self.time_limit = time_limit
        self.ladder = LADDER if ladder is None else ladder
        self.down = LADDER_DOWN if down is None else down
        self.called = False
        self.seconds = 0.0  # spent deciding (inside the partitioner call)

    def __enter__(self) -> _SaveHook:
        self._block = saved_set_choice(self._choose, minimum_cut)
        self._block.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._block.__exit__(*exc)

    def _choose(self, original: Callable[..., list[Any]], joint_graph: Any, node_info: Any, stock: list[Any],
                budget: float) -> list[Any]:
        self.original = original
        self.called = True
        t0 = time.perf_counter()
        try:
            return self.decide(joint_graph, node_info, stock, budget)
        except Exception as exc:
            self.report.notes.append(f"saved-set choice failed, stock set kept ({one_line(exc)})")
            return stock
        finally:
            self.seconds += time.perf_counter() - t0

    def decide(self, joint_graph: Any, node_info: Any, stock: list[Any], budget: float = 1.0) -> list[Any]:
        t0 = time.perf_counter()
        joint, fx_nodes = joint_model(joint_graph, node_info, self.num_fwd_outputs)
        index = {n: i for i, n in enumerate(fx_nodes)}
        pins = bias_bases(fx_nodes, index)
        stock_idx = [index[n] for n in stock if n in index]
        own = choose_saves(joint, stock_idx, time_limit=self.time_limit, pinned=pins)
        decision, start, start_budget = own, stock, budget
        seen = {frozenset(stock_idx): False}  # saved sets tried: whether past the allowance
        tried: list[float] = []
        work = step_work(joint)
        recompute_cap = recompute_limit(own.stock, work)
        t_ladder = time.perf_counter()
        cap = max(30.0, 10 * self.time_limit)  # a guard for huge graphs (far above what the models measured take)

        def start_from(b: float) -> bool | None:
            """Budget `b`'s stock set as a starting point, kept where `preferred`; whether its plan
            recomputes past the allowance (as when first tried, for a set tried before; None: not tried)."""
            nonlocal decision, start, start_budget
            if b >= 1.0 or b <= 0.0 or b == budget or time.perf_counter() - t_ladder > cap:
                return None
            cand = self.original(joint_graph, node_info, memory_budget=b)
            cand_idx = [index[n] for n in cand if n in index]
            key = frozenset(cand_idx)
            if key in seen:
                return seen[key]
            tried.append(b)
            d = choose_saves(joint, cand_idx, time_limit=self.time_limit, pinned=pins, recompute_cap=recompute_cap)
            if preferred(d.chosen, decision.chosen, own.stock, work):
                decision, start, start_budget = d, cand, b
            seen[key] = d.chosen.recompute_cost > recompute_cap
            return seen[key]

        if 0.0 <= budget < 1.0:
            for step in self.ladder:
                start_from(round(budget + step, 6))
            within, past = 1.0, 0.0  # the lowest rung within the allowance, the highest below it past it
            for f in self.down:
                over = start_from(round(budget * f, 6))
                if over is False:
                    within = min(within, f)
                elif over and f < within:
                    past = max(past, f)
            for _ in range(BISECTIONS if past > 0.0 else 0):
                f = (within + past) / 2
                over = start_from(round(budget * f, 6))
                if over is None:
                    break
                within, past = (within, f) if over else (f, past)
            if time.perf_counter() - t_ladder > cap:
                self.report.notes.append(f"other budgets' starting points stopped after {cap:.0f} s")
        r = self.report
        r.ladder_tried, r.ladder_budgets = len(tried), tried
        r.start_budget = start_budget if start_budget != budget else None
        r.stock_estimate = own.stock.peak
        r.saves_estimate = decision.chosen.peak
        r.fw_estimate = decision.chosen.fw_peak
        r.junction_estimate = decision.chosen.junction
        r.saved_added = [fx_nodes[j].name for j in decision.added]
        r.random_saved = [fx_nodes[j].name for j in decision.random_cut]
        r.random_saved_bytes = sum(joint.nodes[j].nbytes for j in decision.random_cut)
        r.masks_saved = [fx_nodes[j].name for j in decision.pinned]
        r.stock_saved_bytes = own.stock.saved_bytes
        r.saved_bytes = decision.chosen.saved_bytes
        r.stock_recompute_cost = own.stock.recompute_cost
        r.recompute_cost = decision.chosen.recompute_cost
        r.step_work = work
        r.save_seconds = time.perf_counter() - t0
        r.stock_random_recomputed = sum(1 for j in own.stock.recomputed if joint.nodes[j].kind == RANDOM)
        r.notes.extend(decision.notes)
        extra = [fx_nodes[j] for j in sorted(set(decision.added) | set(decision.random_cut) | set(decision.pinned))]
        known = set(start)
        return list(start) + [n for n in extra if n not in known]


def _rewrite(gm: Any, fx_nodes: list[Any], prog: Program, edits: list[Any]) -> Any:
    """Replay the pure edits on a copy of the backward graph; returns the new GraphModule."""
    import torch.fx as fx

    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # input/output specs
    env: dict[Any, Any] = {}
    out = graph.graph_copy(gm.graph, env)
    old_out = next(n for n in gm.graph.nodes if n.op == "output")
    new_out = graph.output(out)
    new_out.meta = copy.copy(old_out.meta)
    by_id: dict[int, Any] = {i: env[n] for i, n in enumerate(fx_nodes) if n in env}
    for e in edits:
        before = by_id[e.before]
        remap: dict[Any, Any] = {}

        def arg(x: Any, remap: dict[Any, Any] = remap) -> Any:
            return remap.get(x, x)

        with graph.inserting_before(before):
            for c, nid in zip(e.cone, e.clones, strict=True):
                src = by_id[c]
                clone = graph.node_copy(src, arg)
                remap[src] = clone
                by_id[nid] = clone
        target, clone_t = by_id[e.target], remap[by_id[e.target]]
        for u in e.users:
            by_id[u].replace_input_with(target, clone_t)
    graph.eliminate_dead_code()
    graph.lint()
    return fx.GraphModule(gm, graph)


def partition(fn: Callable[..., Any], gm: Any, joint_inputs: Any, mode: str, kwargs: dict[str, Any],
              time_limit: float = 3.0) -> tuple[Any, Any]:
    """Partition with memprof's saved-set choice and use-site rematerialization (`mode`)."""
    t0 = time.perf_counter()
    report = RematReport(mode=mode)
    hook = _SaveHook(report, int(kwargs.get("num_fwd_outputs", 0)), time_limit)
    try:
        with hook:
            t_fn = time.perf_counter()
            fw, bw = fn(gm, joint_inputs, **kwargs)
            t_fn = time.perf_counter() - t_fn
    except Exception as exc:  # our saved set broke the partitioner: stock partition
        report.status = "fallback"
        report.notes.append(f"partition with memprof's saved set failed ({one_line(exc)}); stock plan used")
        fw, bw = fn(gm, joint_inputs, **kwargs)
        report.seconds = time.perf_counter() - t0
        _attach(bw, report)
        return fw, bw
    if not hook.called:
        report.notes.append("the partitioner chose no saved set (no budget knapsack); only use-site edits")
    try:
        before_random = random_count(bw)
        prog, fx_nodes = bw_program(bw)
        report.bw_estimate_before = walk(prog.nodes, prog.order, prog.start, prog.keep).peak
        result = rematerialize(prog, mode, time_limit=time_limit)
        report.usesite_edits = len(result.edits)
        report.usesite_seconds = result.seconds
        report.usesite_stopped = result.stopped
        report.usesite_added_cost = result.added_cost
        report.bw_estimate_after = result.peak_after
        report.random_before = before_random
        if result.edits:
            new_bw = _rewrite(bw, fx_nodes, prog, result.edits)
            after_random = random_count(new_bw)
            if after_random > before_random:
                raise AssertionError(f"use-site pass duplicated random ops ({before_random} -> {after_random})")
            bw = new_bw
        report.random_after = random_count(bw)
    except Exception as exc:
        report.notes.append(f"use-site pass failed, backward left as partitioned ({one_line(exc)})")
        report.usesite_edits = 0
        report.bw_estimate_after = report.bw_estimate_before
    changed = report.saved_added or report.random_saved or report.masks_saved or report.usesite_edits
    report.status = "applied" if changed else "unchanged"
    report.partition_seconds = t_fn - hook.seconds
    report.seconds = time.perf_counter() - t0 - report.partition_seconds  # the pass's own time
    _attach(bw, report)
    return fw, bw


def reports(clear: bool = False) -> list[RematReport]:
    """The reports of every graph this process partitioned with the pass (oldest first)."""
    with _reports_lock:
        out = list(_reports)
        if clear:
            _reports.clear()
    return out


def _attach(bw: Any, report: RematReport) -> None:
    with contextlib.suppress(Exception):
        bw.meta["memprof_remat"] = report
    with _reports_lock:
        _reports.append(report)
