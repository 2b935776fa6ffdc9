"""Liveness-aware choice of what the forward saves (pure decision code; no torch).

The stock partitioner picks saved values by a FLOP-valued knapsack, then the backward
recomputes everything else from them, each value once, just before its first backward use, and
holds it to its last. When the saved set leaves out the values that split the model into
layers (the residual stream), the first backward op pulls the recomputation of every layer and
the backward holds all of it: the "less budget, more memory" peak.

`choose_saves` starts from the stock saved set and
1. cuts every random op out of the backward's recomputation: it saves the random value, or
   its cheapest set of consumers (a dropout's boolean mask), so the backward never redraws
   randomness (upstream #190758) and no random op is duplicated. Under Inductor the random op is
   the graph's tensor of seeds, so the cut saves a few bytes and the backward recomputes each mask
   from its seed, fused (`torch_hooks.fx.RANDOM_OPS`);
2. saves the masks whose expansion feeds a kernel that Inductor hands dense inputs (`pinned`,
   found by the FX adapter: the attention bias of the CUDA efficient-attention backward). Computed
   in the backward, the expanded view of an unrealized mask is copied dense once (B x H x L x L,
   live across the whole backward); saved, it stays a broadcast view of
   a B x 1 x L x L input;
3. adds the layer-boundary values the backward would otherwise recompute (values the forward
   hands from one layer to the next), when the estimate says the step's peak falls; then drops
   each one whose removal lowers the estimated peak further (not those whose removal leaves it
   unchanged: see the comment in `choose_saves`).
Adding saved values never adds recomputation, so the step's work is at most the stock plan's.
Every candidate set is judged by simulating the partitioner's own extraction and ordering
(`backward_order`) and walking the programs (`graph.walk`), and by the junction between them
(`handed_over`): what is live while the code after the forward turns its outputs into their
gradients, which for a loss compiled apart from the model (transformers') is the step's peak.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from memprof.remat.graph import HEAVY, ITEM, RANDOM, VIEW, Node, NodeArrays, walk


@dataclass
class Joint:
    """A joint forward+backward graph as plain lists (node indices in joint order)."""

    nodes: list[Node]
    forward: list[bool]  # computable without tangents (the forward's nodes and unclaimed ones)
    primals: list[int]  # forward inputs (parameters, user inputs, seeds)
    tangents: list[int]  # backward-only inputs
    fw_outputs: list[int]
    bw_outputs: list[int]

    def __post_init__(self) -> None:
        users: list[list[int]] = [[] for _ in self.nodes]
        for j, nd in enumerate(self.nodes):
            for k in nd.inputs:
                users[k].append(j)
        self.users = users
        self._inputs = set(self.primals) | set(self.tangents)
        self.arrays = NodeArrays.of(self.nodes)  # (the nodes do not change: every walk of them shares it)


@dataclass
class Evaluation:
    """One saved set, simulated: the programs, their peaks and the recomputed work."""

    saved: frozenset[int]  # saved values the backward uses (plus primals it needs)
    fw_peak: int
    bw_peak: int
    recomputed: list[int]
    recompute_cost: float
    bw_order: list[int]
    saved_bytes: int
    at_peak: frozenset[int] = frozenset()  # storage roots live at the peak (in every program that reaches it)
    junction: int = 0  # saved bytes + outputs and their gradients, between the forward and the backward

    @property
    def peak(self) -> int:
        return max(self.fw_peak, self.bw_peak, self.junction)


@dataclass
class SaveDecision:
    saved: list[int]
    stock: Evaluation
    chosen: Evaluation
    added: list[int] = field(default_factory=list)  # layer-boundary values added
    random_cut: list[int] = field(default_factory=list)  # values saved so no random op is recomputed
    pinned: list[int] = field(default_factory=list)  # masks saved so no expansion of them is made dense
    evaluations: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def backward_needs(joint: Joint, saved: set[int]) -> tuple[set[int], set[int]]:
    """(nodes the backward executes, inputs it reads) for a saved set: the closure of its outputs."""
    return _close(joint, saved, set(), set(), list(joint.bw_outputs))


def needs_without(joint: Joint, needs: tuple[set[int], set[int]], saved: set[int],
                  j: int) -> tuple[set[int], set[int]]:
    """`backward_needs(joint, saved)` where `needs` are those of `saved | {j}`: the backward now
    also recomputes what making `j` takes (the closure only grows where a saved value is dropped)."""
    execute, reads = needs
    if j not in reads or j in joint._inputs:  # (the backward never reads it: nothing changes)
        return needs
    return _close(joint, saved, set(execute), reads - {j}, [j])


def _close(joint: Joint, saved: set[int], execute: set[int], reads: set[int],
           stack: list[int]) -> tuple[set[int], set[int]]:
    nodes = joint.nodes
    while stack:
        j = stack.pop()
        if j in execute or j in reads:
            continue
        if j in saved or j in joint._inputs:
            reads.add(j)
            continue
        execute.add(j)
        stack.extend(nodes[j].inputs)
    return execute, reads


def backward_order(joint: Joint, execute: set[int]) -> list[int]:
    """The partitioner's backward order (`reordering_to_mimic_autograd_engine`): each node runs
    after the not-yet-run forward values it needs, which run in joint order just before it."""
    tangent_users = [u for t in joint.tangents for u in joint.users[t] if u in execute]
    if not tangent_users:
        return sorted(execute)
    first = min(tangent_users)
    done: set[int] = set()
    order: list[int] = []
    nodes = joint.nodes
    for j in sorted(execute):
        if j < first or j in done:
            continue
        pending: list[int] = []
        stack = [j]
        while stack:
            k = stack.pop()
            if k in done or k not in execute:
                continue
            done.add(k)
            pending.append(k)
            stack.extend(nodes[k].inputs)
        pending.sort()
        order.extend(pending)
    return order


def forward_order(joint: Joint, saved: Iterable[int]) -> list[int]:
    nodes = joint.nodes
    need: set[int] = set()
    stack = [*joint.fw_outputs, *saved]
    while stack:
        j = stack.pop()
        if j in need or j in joint._inputs:
            continue
        need.add(j)
        stack.extend(nodes[j].inputs)
    return sorted(need)


def handed_over(joint: Joint, saved: Iterable[int] = ()) -> int:
    """Bytes the pair hands to the code after it that are live together with everything it saves:
    its outputs and, made from them, their gradients (the tangents). Between the forward and the
    backward, whatever runs next (a loss compiled apart, as transformers' causal-LM loss is) keeps
    the outputs it needs for its own backward, which makes their gradients from them: the bf16
    logits and their gradient are both live there, on top of every saved value. Outputs are
    counted up to the tangents' bytes (only outputs with a gradient have a tangent); those that are
    also `saved` are counted there."""
    nodes = joint.nodes
    tangents = sum(nodes[t].nbytes for t in joint.tangents)
    skip = set(saved) | joint._inputs
    outputs = sum(nodes[j].nbytes for j in set(joint.fw_outputs)
                  if nodes[j].alias < 0 and not nodes[j].resident and j not in skip)
    return tangents + min(outputs, tangents)


def evaluate(joint: Joint, saved: set[int], fuse: bool = True,
             needs: tuple[set[int], set[int]] | None = None) -> Evaluation:
    """Simulate saved set `saved` (`needs`: its `backward_needs`, where known)."""
    execute, reads = needs if needs is not None else backward_needs(joint, saved)
    used = frozenset(r for r in reads if r not in joint.tangents)
    fw = forward_order(joint, used)
    keep = [*joint.fw_outputs, *(j for j in used if j not in joint._inputs)]
    fw_walk = walk(joint.arrays, fw, (), keep, fuse=fuse, detail=True)
    bw = backward_order(joint, execute)
    bw_walk = walk(joint.arrays, bw, reads, joint.bw_outputs, fuse=fuse, detail=True)
    recomputed = sorted(j for j in execute if joint.forward[j])
    saved_bytes = sum(joint.nodes[j].nbytes for j in used if not joint.nodes[j].resident)
    junction = saved_bytes + handed_over(joint, used)
    top = max(fw_walk.peak, bw_walk.peak, junction)
    at_peak = [set(w.live_at_peak) for w in (fw_walk, bw_walk) if w.peak == top]
    if junction == top:  # every saved value is live there
        at_peak.append({j for j in used if not joint.nodes[j].resident})
    return Evaluation(used, fw_walk.peak, bw_walk.peak, recomputed,
                      sum(joint.nodes[j].cost for j in recomputed), bw, saved_bytes,
                      frozenset(set.intersection(*at_peak)), junction)


def _random_cut(joint: Joint, saved: set[int]) -> list[int]:
    """Values to save so that the backward recomputes no random op (cheapest of the op or its consumers)."""
    nodes = joint.nodes
    added: list[int] = []
    for _ in range(len(nodes)):
        execute, _reads = backward_needs(joint, saved)
        rand = [j for j in sorted(execute) if nodes[j].kind == RANDOM and joint.forward[j]]
        if not rand:
            return added
        j = rand[-1]  # the latest: its consumers are the ones the backward reads
        consumers = [u for u in joint.users[j] if u in execute]
        cut: list[int] = [j]
        items = [u for u in consumers if nodes[u].kind == ITEM]
        if items and len(items) == len(consumers):  # a multi-output op (native_dropout): save its outputs
            cut = items
        elif consumers and all(joint.forward[u] and nodes[u].kind != RANDOM for u in consumers):
            through = [u for u in consumers if nodes[u].kind in (VIEW, ITEM) or nodes[u].alias == j]
            if not through and sum(nodes[u].nbytes for u in consumers) < nodes[j].nbytes:
                cut = consumers
        for u in cut:
            saved.add(u)
            added.append(u)
    raise RuntimeError("random-op cut did not converge")


def boundary_values(joint: Joint, execute: set[int]) -> list[int]:
    """Forward values the backward recomputes that one layer hands to another (the residual stream)."""
    nodes = joint.nodes
    out: list[int] = []
    for j in sorted(execute):
        nd = nodes[j]
        if not joint.forward[j] or nd.kind in (RANDOM, VIEW) or nd.alias >= 0 or nd.nbytes <= 0 or not nd.layer:
            continue
        if any(nodes[u].layer and nodes[u].layer != nd.layer and joint.forward[u] for u in joint.users[j]):
            out.append(j)
    return out


def _chains_layers(joint: Joint, execute: set[int], j: int) -> bool:
    """Whether, without `j` saved, the backward recomputes matrix multiplies of two or more layers
    to make `j`, which feeds another layer's recomputation: a chain down the residual stream.
    Inductor fuses a chain of residual adds into one kernel, which runs once every layer's
    recomputed projections are made, so all of them are live at once (the walk's estimate schedules
    each value just before its first use and does not see it). One layer's boundary recomputed from
    the saved boundary below it holds that layer's projections only, which the estimate sees; so
    does a chain over saved projections, which recomputes pointwise ops only. `execute`: what the
    backward executes without `j` saved."""
    nodes = joint.nodes
    if j not in execute or not any(u in execute and joint.forward[u] and nodes[u].layer != nodes[j].layer
                                   for u in joint.users[j]):
        return False
    seen, stack, heavy = set(), [j], set()
    while stack:  # j's recomputation: the recomputed values it is made from
        k = stack.pop()
        if k in seen or k not in execute:
            continue
        seen.add(k)
        if nodes[k].kind == HEAVY:
            heavy.add(nodes[k].layer)
            if len(heavy) > 1:
                return True
        stack.extend(nodes[k].inputs)
    return False


# A saved set that recomputes more than the stock plan is taken only when it lowers the estimated
# peak by MIN_GAIN at least and its extra recomputation stays within RECOMPUTE_ALLOWANCE of the
# step's work (every op's cost, forward and backward, as `Node.cost` counts it) beyond the stock
# plan's. The bound on step time is 5% over stock at the same budget. Measured on the H200
# (docs/benchmarks.md, "Session 16"): the bf16 GQA decoder at 0.10 takes budget 0.05's set for
# 2.3% of the step's work, 8% lower, at 0.98x stock's GPU time; at 0.06, budget 0.03's set for
# 0.3%, 0.64% lower by the estimate (1.2% measured: the step is then under per-layer
# checkpointing). Judging the trade against the best set so far instead of the stock plan was tried
# and taken back: it kept the bf16 GPT-2 at 0.10 at 3,121 MB, over per-layer checkpointing. It was
# 3% until session 22 (H100): the paper BERT at 0.10 (batch 16) then took budget 0.0625's set, 2,153 MB
# against per-layer checkpointing's 1,907 MB; at 4% it takes 0.05's (+3.8% of the work), 1,888.8 MB
# at 1.012x stock's step time, and the bf16 GPT-2 at 0.10 goes from 2,871.1 to 2,833.4 MB (+3.4%).
RECOMPUTE_ALLOWANCE = 0.04
MIN_GAIN = 0.005


def step_work(joint: Joint) -> float:
    """The step's work without recomputation: every op's cost, forward and backward."""
    return sum(nd.cost for nd in joint.nodes)


def recompute_limit(stock: Evaluation, work: float) -> float:
    """The most recomputation a saved set may take: the stock plan's plus RECOMPUTE_ALLOWANCE × `work`."""
    return stock.recompute_cost + RECOMPUTE_ALLOWANCE * work


def preferred(cand: Evaluation, best: Evaluation, stock: Evaluation, work: float) -> bool:
    """Whether saved set `cand` replaces `best`: a lower estimated peak (a tie: less recomputation)
    at no more recomputation than the stock plan's, or a peak lower by MIN_GAIN for at most
    RECOMPUTE_ALLOWANCE × `work` recomputed beyond the stock plan."""
    if (cand.peak, cand.recompute_cost) >= (best.peak, best.recompute_cost):
        return False
    extra = cand.recompute_cost - stock.recompute_cost
    if extra <= 0 or cand.recompute_cost <= best.recompute_cost:
        return True
    return cand.recompute_cost <= recompute_limit(stock, work) and cand.peak <= (1.0 - MIN_GAIN) * best.peak


def choose_saves(joint: Joint, stock: Sequence[int], time_limit: float = 3.0, fuse: bool = True,
                 pinned: Sequence[int] = (), recompute_cap: float | None = None) -> SaveDecision:
    """The saved set: the stock one, made random-safe, with `pinned` values saved where the backward
    would recompute them, and extended by layer boundaries where that pays. A boundary is dropped
    only while the plan's recomputation stays within `recompute_cap` (by default the stock set's
    plus RECOMPUTE_ALLOWANCE of the step's work): a drop adds the boundary's recomputation, and
    past the allowance `preferred` would refuse the whole set, where stopping short of it keeps
    most of the gain (the bf16 GPT-2 at budget 0.10 on the H200: docs/benchmarks.md, session 17)."""
    t0 = time.perf_counter()
    stock_set = set(stock)
    stock_eval = evaluate(joint, stock_set, fuse)
    if recompute_cap is None:
        recompute_cap = recompute_limit(stock_eval, step_work(joint))
    evaluations = 1
    saved = set(stock_set)
    cut = _random_cut(joint, saved)
    execute, _ = backward_needs(joint, saved)
    pins = sorted({j for j in pinned if j in execute and joint.forward[j] and joint.nodes[j].kind != RANDOM})
    saved |= set(pins)
    current = evaluate(joint, saved, fuse) if cut or pins else stock_eval
    evaluations += bool(cut or pins)
    decision = SaveDecision(sorted(saved), stock_eval, current, [], cut, pins)
    execute, _ = backward_needs(joint, saved)
    extra = boundary_values(joint, execute)
    if extra:
        trial = evaluate(joint, saved | set(extra), fuse)
        evaluations += 1
        if (trial.peak, trial.recompute_cost) < (current.peak, current.recompute_cost):
            saved |= set(extra)
            current = trial
            needs = backward_needs(joint, saved)
            added = list(extra)
            # drop a boundary only where the estimate says that lowers the peak (largest first). A
            # boundary whose removal merely leaves the estimate unchanged stays: without it the
            # backward recomputes a chain of residual adds across layers, which Inductor inlines
            # into one kernel that holds every layer's projection outputs until it runs, which the
            # estimate does not model (docs/benchmarks.md, "Figures behind design choices")
            for j in sorted(extra, key=lambda k: -joint.nodes[k].nbytes):
                if j not in current.at_peak:
                    # not live at the peak: dropping it cannot lower it. The backward then computes
                    # it (and what it needs) at its first use, keeping the order of everything else,
                    # so no step's live bytes fall except where it was live before (the same choices
                    # with and without this filter: docs/benchmarks.md, "Figures behind design choices")
                    continue
                if time.perf_counter() - t0 > time_limit:
                    decision.notes.append(f"pruning stopped after {time_limit:.1f} s")
                    break
                fewer = saved - {j}
                trial_needs = needs_without(joint, needs, fewer, j)
                if _chains_layers(joint, trial_needs[0], j):
                    continue
                trial = evaluate(joint, fewer, fuse, trial_needs)
                evaluations += 1
                if trial.peak < current.peak and trial.recompute_cost <= recompute_cap:
                    saved.discard(j)
                    added.remove(j)
                    current, needs = trial, trial_needs
            decision.added = added
    decision.saved = sorted(saved)
    decision.chosen = current
    decision.evaluations = evaluations
    decision.seconds = time.perf_counter() - t0
    return decision
