"""The remat pass's pure parts: the liveness estimate, the saved-set choice, use-site edits."""

from __future__ import annotations

import itertools

import pytest

from memprof.remat.graph import HEAVY, INPUT, POINTWISE, RANDOM, REDUCTION, VIEW, Node, walk
from memprof.remat.saves import (
    RECOMPUTE_ALLOWANCE,
    Evaluation,
    Joint,
    backward_needs,
    backward_order,
    boundary_values,
    choose_saves,
    evaluate,
    handed_over,
    needs_without,
    preferred,
    step_work,
)
from memprof.remat.usesite import Program, rematerialize


def test_walk_counts_exact_bytes_with_views_fusion_and_inputs() -> None:
    nodes = [
        Node("saved", INPUT, (), 100),  # 0: live from the start, freed after its last use
        Node("param", INPUT, (), 10_000, resident=True),  # 1: resident: costs nothing
        Node("a", HEAVY, (0, 1), 40),  # 2
        Node("v", VIEW, (2,), 0, alias=2),  # 3: keeps a alive
        Node("p", POINTWISE, (3,), 40),  # 4: single pointwise consumer -> fused, allocates nothing
        Node("q", POINTWISE, (4,), 40),  # 5
        Node("r", REDUCTION, (5, 3), 4),  # 6
    ]
    w = walk(nodes, [2, 3, 4, 5, 6], start=[0, 1], keep=[6])
    # start 100; a: 140 (saved freed after a); q: 40+40 (p fused into q); r: +4 while a, q live
    assert w.start == 100
    assert w.peak == 140 and w.peak_at == 0
    unfused = walk(nodes, [2, 3, 4, 5, 6], start=[0, 1], keep=[6], fuse=False)
    assert unfused.peak == 140
    late = walk(nodes, [2, 3, 4, 5, 6], start=[1], keep=[6])
    assert late.peak == 40 + 4  # a (held through v), r; p and q are fused into the reduction r
    assert late.live_at_peak == [2, 6]
    assert walk(nodes, [2, 3, 4, 5, 6], start=[1], keep=[6], fuse=False).peak == 40 + 40 + 40  # a, p, q at q


def test_walk_keeps_outputs_and_frees_dead_values() -> None:
    nodes = [Node("x", INPUT, (), 8), Node("dead", POINTWISE, (0,), 1000), Node("out", HEAVY, (0,), 16),
             Node("t", HEAVY, (2,), 32)]
    w = walk(nodes, [1, 2, 3], start=[0], keep=[2, 3])
    assert w.peak == 8 + 1000
    assert walk(nodes, [2, 3], start=[0], keep=[2, 3]).peak == 8 + 16 + 32 - 8  # x freed after out


def _chain_joint(layers: int, random_layer: int | None = None, out_bytes: int = 4) -> tuple[Joint, list[int]]:
    """A residual chain: h_{i+1} = h_i + mm(h_i) per layer, loss = sum(h_L); its backward. With
    `out_bytes`, the output (and its tangent) is that big: logits handed to a loss compiled apart."""
    nodes: list[Node] = [Node("w", INPUT, (), 0, resident=True), Node("x", INPUT, (), 0, resident=True)]
    fw: list[bool] = [True, True]
    h = 1
    hs = [h]
    mms = []
    for i in range(layers):
        nodes.append(Node(f"mm{i}", HEAVY, (h, 0), 100, cost=1000.0, layer=f"layers.{i}"))
        fw.append(True)
        mm = len(nodes) - 1
        if random_layer == i:
            nodes.append(Node(f"rand{i}", RANDOM, (mm,), 100, cost=100.0, clonable=False, layer=f"layers.{i}"))
            fw.append(True)
            nodes.append(Node(f"mask{i}", POINTWISE, (len(nodes) - 1,), 25, cost=100.0, layer=f"layers.{i}"))
            fw.append(True)
            nodes.append(Node(f"drop{i}", POINTWISE, (mm, len(nodes) - 1), 100, cost=100.0, layer=f"layers.{i}"))
            fw.append(True)
            mm = len(nodes) - 1
        mms.append(mm)
        nodes.append(Node(f"h{i + 1}", POINTWISE, (h, mm), 100, cost=100.0, layer=f"layers.{i}"))
        fw.append(True)
        h = len(nodes) - 1
        hs.append(h)
    nodes.append(Node("loss", REDUCTION, (h,), out_bytes, cost=100.0))
    fw.append(True)
    loss = len(nodes) - 1
    nodes.append(Node("tangent", INPUT, (), out_bytes))
    fw.append(False)
    t = len(nodes) - 1
    g = t
    grads = []
    for i in reversed(range(layers)):
        # grad of layer i needs h_i (its input) and the incoming grad
        nodes.append(Node(f"gw{i}", HEAVY, (g, hs[i]), 10, cost=1000.0))
        fw.append(False)
        grads.append(len(nodes) - 1)
        nodes.append(Node(f"g{i}", POINTWISE, (g, mms[i]), 100, cost=100.0))
        fw.append(False)
        g = len(nodes) - 1
    return Joint(nodes, fw, [0, 1], [t], [loss], [*grads, g]), hs


def test_backward_order_recomputes_before_first_use_and_boundaries_cut_the_chain() -> None:
    joint, _ = _chain_joint(6)
    stock = evaluate(joint, {0, 1})  # budget 0: recompute everything
    order_names = [joint.nodes[j].name for j in stock.bw_order]
    # the whole chain (h1 .. h5) is recomputed before the first gradient and held
    assert order_names.index("h1") < order_names.index("h5") < order_names.index("gw5")
    decision = choose_saves(joint, [0, 1])
    assert decision.added  # layer boundaries pay here
    assert decision.chosen.peak < decision.stock.peak
    assert decision.chosen.recompute_cost <= decision.stock.recompute_cost
    order = backward_order(joint, set(decision.chosen.bw_order))
    assert order == decision.chosen.bw_order


def test_a_set_that_recomputes_more_wins_only_by_a_clear_margin_within_the_allowance() -> None:
    """`preferred`: more recomputation than the stock plan is taken for a peak 0.5% lower at least,
    and only within the allowance (`RECOMPUTE_ALLOWANCE`, 4%) of the step's work beyond the stock plan's."""
    joint, _ = _chain_joint(6)
    work = step_work(joint)
    assert work == sum(nd.cost for nd in joint.nodes) > 0
    stock = evaluate(joint, {0, 1})
    r0 = stock.recompute_cost
    assert RECOMPUTE_ALLOWANCE == 0.04
    step = RECOMPUTE_ALLOWANCE * work

    def ev(peak: int, recompute: float) -> Evaluation:
        return Evaluation(frozenset(), peak, 0, [], recompute, [], 0)

    base = ev(1000, r0)
    assert preferred(ev(999, r0), base, stock, work)  # lower, no more work than stock: always
    assert preferred(ev(1000, r0 - 1), base, stock, work)  # a tie: less work wins
    assert not preferred(ev(1000, r0), base, stock, work)
    assert not preferred(ev(996, r0 + 1), base, stock, work)  # 0.4% lower: not worth more work
    assert preferred(ev(995, r0 + step), base, stock, work)
    assert not preferred(ev(500, r0 + step + 1), base, stock, work)  # past the allowance, however low
    # a set that already recomputes more than stock is replaced by any lower one that recomputes less
    lavish = ev(1000, r0 + step)
    assert preferred(ev(999, r0 + step / 2), lavish, stock, work)
    assert not preferred(ev(999, r0 + step + 1), lavish, stock, work)


def test_outputs_handed_to_a_loss_compiled_apart_bound_the_saved_set() -> None:
    # transformers' loss is its own compiled pair: it keeps the model's logits and makes their
    # gradient from them while every value the model's pair saved is live
    joint, _ = _chain_joint(8, out_bytes=1000)
    assert handed_over(joint) == 2000 and handed_over(joint, saved=[joint.fw_outputs[0]]) == 1000
    execute, _ = backward_needs(joint, {0, 1})
    boundaries = boundary_values(joint, execute)
    stock = evaluate(joint, {0, 1})
    every = evaluate(joint, {0, 1, *boundaries})
    assert every.junction == every.saved_bytes + 2000 == 2700
    assert every.peak == every.junction > stock.peak == stock.bw_peak == 2510  # all boundaries: worse
    decision = choose_saves(joint, [0, 1])
    assert decision.added == [] and decision.chosen.peak == stock.peak  # judged without the junction: 1810 "won"
    assert every.bw_peak == 1810 < stock.peak
    # a small output (a loss in the same graph): the junction is no constraint, boundaries pay. A
    # boundary goes only where its layer is recomputed from the saved boundary below it: no two
    # neighbours go, which would chain one layer's recomputed matmul into the next's
    small, _ = _chain_joint(8)
    names = {n.name: i for i, n in enumerate(small.nodes)}
    decision = choose_saves(small, [0, 1])
    kept = {small.nodes[j].name for j in decision.added}
    dropped = [i for i in range(1, 8) if f"h{i}" not in kept]
    assert dropped and all(b - a > 1 for a, b in itertools.pairwise(dropped))
    every = evaluate(small, {0, 1} | {names[f"h{i}"] for i in range(1, 8)})
    assert decision.chosen.peak < every.peak and decision.chosen.recompute_cost == every.recompute_cost + 200
    # each drop recomputes its boundary (one add here): a cap on recomputation stops the drops
    capped = choose_saves(small, [0, 1], recompute_cap=every.recompute_cost + 100)
    assert len(capped.added) == 6 and capped.chosen.recompute_cost == every.recompute_cost + 100
    assert decision.chosen.peak <= capped.chosen.peak < every.peak
    assert len(choose_saves(small, [0, 1], recompute_cap=every.recompute_cost).added) == 7


def test_a_boundary_stays_where_dropping_it_chains_matmuls_across_layers() -> None:
    """Without h1 and h2 saved, the backward recomputes h2 with layer 1's matmul from h1, itself
    recomputed with layer 0's: down the residual stream, Inductor fuses such a chain into one kernel
    that holds every layer's recomputed matmul at once, which the walk does not model. h2 alone
    (h1 saved) is one layer's recomputation, which the walk does model; with layer 0's matmul
    saved, h1 is one add from saved values, and the chain recomputes one layer's matmul only."""
    from memprof.remat.saves import _chains_layers

    joint, _ = _chain_joint(4)
    names = {n.name: i for i, n in enumerate(joint.nodes)}
    boundaries = {names[f"h{i}"] for i in range(1, 4)}

    def chains(saved: set[int], j: int) -> bool:
        return _chains_layers(joint, backward_needs(joint, saved)[0], j)

    assert not chains({0, 1} | boundaries - {names["h2"]}, names["h2"])
    assert chains({0, 1} | boundaries - {names["h1"], names["h2"]}, names["h2"])
    assert not chains({0, 1, names["mm0"]} | boundaries - {names["h1"], names["h2"]}, names["h2"])
    assert not chains({0, 1} | boundaries, names["h2"])  # (saved: nothing recomputes it)


def test_what_dropping_one_saved_value_adds_is_the_closure_without_it() -> None:
    """`needs_without` grows the backward's closure by what remaking the dropped value takes:
    the same sets as the closure computed anew, for every saved subset of a chain and every value."""
    joint, _ = _chain_joint(3, random_layer=1)
    forward = [j for j, fw in enumerate(joint.forward) if fw]
    for mask in range(0, 1 << len(forward), 7):
        saved = {j for b, j in enumerate(forward) if mask >> b & 1}
        for j in saved:
            assert needs_without(joint, backward_needs(joint, saved), saved - {j}, j) == \
                backward_needs(joint, saved - {j})


def test_random_ops_are_never_recomputed_and_the_mask_is_the_cheapest_cut() -> None:
    joint, _ = _chain_joint(3, random_layer=1)
    names = {n.name: i for i, n in enumerate(joint.nodes)}
    stock = evaluate(joint, {0, 1})
    assert names["rand1"] in stock.recomputed  # the stock plan would redraw
    decision = choose_saves(joint, [0, 1])
    assert [joint.nodes[j].name for j in decision.random_cut] == ["mask1"]  # 25 B instead of 100 B
    assert all(joint.nodes[j].kind != RANDOM for j in decision.chosen.recomputed)


def test_pinned_masks_are_saved_only_where_the_backward_would_recompute_them() -> None:
    joint, _ = _chain_joint(3)
    names = {n.name: i for i, n in enumerate(joint.nodes)}
    stock = evaluate(joint, {0, 1})
    assert names["h2"] in stock.recomputed
    decision = choose_saves(joint, [0, 1], pinned=[names["h2"], names["tangent"], names["gw0"]])
    assert decision.pinned == [names["h2"]]  # a tangent and a backward value are never saved
    assert names["h2"] in decision.saved and names["h2"] not in decision.chosen.recomputed
    assert decision.chosen.recompute_cost <= stock.recompute_cost
    assert choose_saves(joint, [0, 1, names["h2"]], pinned=[names["h2"]]).pinned == []  # already saved


def _program() -> Program:
    # x (saved, 100) -> a = x*2 (pointwise 100) used at step 1 and at the very end;
    # a big temporary (1000) in between is the peak.
    nodes = [Node("x", INPUT, (), 100), Node("a", POINTWISE, (0,), 100), Node("b", HEAVY, (1,), 10),
             Node("big", HEAVY, (2,), 1000), Node("c", HEAVY, (3,), 10), Node("d", HEAVY, (1, 4), 10),
             Node("y", INPUT, (), 0, resident=True)]
    return Program(nodes, [1, 2, 3, 4, 5], start=[0, 6], keep=[5])


def test_use_site_moves_late_use_and_never_raises_the_estimate() -> None:
    prog = _program()
    before = walk(prog.nodes, prog.order, prog.start, prog.keep).peak
    res = rematerialize(prog, "light")
    after = walk(prog.nodes, prog.order, prog.start, prog.keep).peak
    assert res.peak_before == before and res.peak_after == after
    assert res.trace == sorted(res.trace, reverse=True)
    # `a` is recomputed next to d, from x — but x itself is held, so nothing is gained here; heavy
    # cones need "all"
    assert after <= before


def test_use_site_in_all_mode_clones_matmuls_only_when_the_peak_falls() -> None:
    nodes = [Node("x", INPUT, (), 10), Node("w", INPUT, (), 0, resident=True),
             Node("m", HEAVY, (0, 1), 400, cost=1e6),  # 2: big, used early and late
             Node("e", HEAVY, (2,), 10),  # 3: early use
             Node("big", HEAVY, (3,), 1000),  # 4: the peak
             Node("f", HEAVY, (4,), 10),  # 5
             Node("late", HEAVY, (2, 5), 10)]  # 6: late use of m
    light = Program([Node(**{s: getattr(n, s) for s in n.__slots__}) for n in nodes], [2, 3, 4, 5, 6], [0, 1], [6])
    assert rematerialize(light, "light").edits == []  # a matmul is not cloned in light mode
    full = Program(nodes, [2, 3, 4, 5, 6], [0, 1], [6])
    res = rematerialize(full, "all")
    assert len(res.edits) == 1 and res.peak_after < res.peak_before
    assert res.peak_before == 400 + 10 + 1000 and res.peak_after == 10 + 10 + 1000  # x now held for the clone


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown remat mode"):
        rematerialize(_program(), "everything")
