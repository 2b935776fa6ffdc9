"""Attribution on real compiled models (CPU, Inductor): plans, the buffer join, categories, rows.

Each model is compiled once per module (about 30 s each on a CI core) and shared by the tests.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import memprof
from memprof.analysis.attribution import CATEGORIES, Category

from ..conftest import ROOT, invoke_memprof, run_memprof

sys.path.insert(0, str(ROOT / "examples"))
import train_bert
import train_llama


class _Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(module: object, budget: float, steps: int = 2) -> tuple[memprof.Capture, list[str]]:
    """Capture a compiled model's training steps with the partitioner's debug logging on, and the
    graph caches off: a hit in AOTAutograd's cache (another test compiled the same model) would
    replay the partition from memprof's record and leave the partitioner's log empty. The kernels'
    cache stays: a kernel another test built is not built again."""
    import torch._functorch.config as functorch_config
    import torch._functorch.partitioners as partitioners
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    logs = _Logs()
    logger = logging.getLogger("torch._functorch.partitioners")
    logger.addHandler(logs)
    old_level, old_debug = logger.level, partitioners.AOT_PARTITIONER_DEBUG
    logger.setLevel(logging.INFO)
    partitioners.AOT_PARTITIONER_DEBUG = True
    try:
        with inductor_config.patch(force_disable_caches=True), \
                functorch_config.patch(activation_memory_budget=budget), memprof.capture() as cap:
            model, ids = module.build(module.SMALL, "cpu")  # type: ignore[attr-defined]
            step = torch.compile(model)
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(steps):
                step(input_ids=ids).last_hidden_state.sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        logger.removeHandler(logs)
        logger.setLevel(old_level)
        partitioners.AOT_PARTITIONER_DEBUG = old_debug
    return cap, logs.lines


@pytest.fixture(scope="module")
def llama() -> Iterator[tuple[memprof.Capture, list[str]]]:
    yield _train(train_llama, 0.1)


@pytest.fixture(scope="module")
def bert() -> Iterator[tuple[memprof.Capture, list[str]]]:
    yield _train(train_bert, 1.0)


def _check_plan_against_partitioner_log(plan: memprof.plans.Plan, lines: list[str]) -> None:
    sizes = next(line for line in lines if line.startswith("Theoretical Per Activation Storage Sizes"))
    logged_saved = set(re.findall(r"'([^']+)'\)", sizes))
    counts = next(line for line in lines if line.startswith("# remat/fw/bw"))
    remat, fw_ops, bw_ops = (int(x) for x in counts.split(": ")[1].split("/"))
    fw = plan.forward.by_name
    assert logged_saved <= set(plan.saved)
    # what the log leaves out are the symbolic (non-tensor) saved values
    assert all(fw[n].dtype is None for n in set(plan.saved) - logged_saved)
    assert len(plan.recomputed) == remat
    assert sum(n.op == "call_function" for n in plan.forward.nodes) == fw_ops
    assert sum(n.op == "call_function" for n in plan.backward.nodes) == bw_ops
    by_op = next(line for line in lines if line.startswith("Count of Ops Rematerialized"))
    logged = dict(re.findall(r"\('([^']+)', (\d+)\)", by_op))
    ours: dict[str, int] = {}
    for name in plan.recomputed:
        target = fw[name].target
        packet = target.rsplit(".", 1)[0] if target.count(".") >= 2 else target
        ours[packet] = ours.get(packet, 0) + 1
    assert {k: int(v) for k, v in logged.items()} == {k: v for k, v in ours.items() if k in logged}


def _assert_rows_sum(cap: memprof.Capture) -> None:
    for at in ("peak", "step:1", "step:2"):
        tl = cap.timeline("cpu")
        for by in ("category", "node", "layer", "kernel"):
            rows = cap.attribution(at=at, by=by, device="cpu")
            total = sum(r.bytes for r in rows)
            if at == "peak":
                assert total == cap.peak("cpu") == tl.peak
            else:
                assert total == cap.peak("cpu", step=int(at[5:]))
            assert abs(sum(r.share for r in rows) - 1.0) < 1e-9
            assert all(r.bytes > 0 and r.count >= 0 for r in rows)


def test_llama_plan_matches_the_partitioners_own_log(llama: tuple[memprof.Capture, list[str]]) -> None:
    cap, lines = llama
    assert len(cap.plans) == 1
    plan = cap.plans[0]
    assert plan.backend == "inductor" and plan.budget == 0.1 and plan.status == "ok"
    _check_plan_against_partitioner_log(plan, lines)
    assert plan.recomputed and plan.saved and not plan.random_ops and not plan.recomputed_random
    # recomputed nodes are defined before their first backward use
    assert [r.name for r in plan.recompute_sites] == plan.recomputed
    assert all(r.defined_at < r.first_use <= r.last_use for r in plan.recompute_sites)
    assert {g.role for g in cap.graphs} == {"forward", "backward"}
    assert all(g.plan == 0 for g in cap.graphs)


def _scopes_in_calls(cap: memprof.Capture) -> list[set[str]]:
    """The names of the scopes opened inside each compiled-graph call (any depth), in call order."""
    calls: list[set[str]] = []
    stack: list[str] = []
    raw = cap.raw[np.isin(cap.raw["kind"], (2, 3))]
    for kind, scope in zip(raw["kind"].tolist(), raw["scope"].tolist(), strict=True):
        name = cap.scope_name(int(scope))
        if kind == 3:
            if name in stack:
                del stack[len(stack) - 1 - stack[::-1].index(name):]
            continue
        if name.startswith("## Call CompiledFxGraph"):
            calls.append(set())
        elif any(s.startswith("## Call CompiledFxGraph") for s in stack):
            calls[-1].add(name)
        stack.append(name)
    return calls


def test_llama_every_graph_call_is_joined_to_buffers(llama: tuple[memprof.Capture, list[str]]) -> None:
    """Every call is joined buffer by buffer, the second step's too, whose calls ran quiet: no op
    scope inside them but those memprof opened around the calls that return fresh tensors
    (attention, cumsum), and the overloads it wrapped for that are the builtins again after."""
    cap, _ = llama
    labels = cap.labels("cpu")
    assert len(labels.calls) == 4  # forward + backward, two steps
    assert all(c.level == "buffer" for c in labels.calls), [c.reason for c in labels.calls]
    first, second = _scopes_in_calls(cap)[:2], _scopes_in_calls(cap)[2:]
    assert all("aten::mm" in names for names in first), first
    fresh = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::cumsum")  # (the backward recomputes both)
    assert len(second) == 2 and all(names and all(n.startswith(fresh) for n in names) for names in second), second
    assert type(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default._op).__name__ == \
        "builtin_function_or_method"


def test_llama_attribution_sums_to_the_peak_to_the_byte(llama: tuple[memprof.Capture, list[str]]) -> None:
    cap, _ = llama
    _assert_rows_sum(cap)
    at_peak = {r.key: r.bytes for r in cap.attribution(by="category", device="cpu")}
    assert "unattributed" not in at_peak  # CPU: nothing predates the capture
    seen = {CATEGORIES[c] for c in np.unique(cap.labels("cpu").category)}
    assert {"parameter", "gradient", "optimizer_state", "input", "saved_activation", "recomputed",
            "temporary"} <= seen
    assert "rng_mask" not in seen  # no dropout in Llama


def test_llama_exact_bytes_of_known_tensors(llama: tuple[memprof.Capture, list[str]]) -> None:
    cap, _ = llama
    params = {r.key: r.bytes for r in cap.attribution(by="node", device="cpu") if r.category == "parameter"}
    # AdamW's two moments per parameter, parameters themselves: exact storage bytes
    assert params["parameter:embed_tokens.weight"] == 1000 * 64 * 4
    assert params["parameter:layers.0.mlp.gate_proj.weight"] == 172 * 64 * 4
    layers = {r.key for r in cap.attribution(by="layer", device="cpu")}
    assert {"layers.0", "layers.1", "embed_tokens"} <= layers


def test_saved_activations_are_the_forward_outputs_kept_for_backward(llama: tuple[memprof.Capture, list[str]]) -> None:
    cap, _ = llama
    plan = cap.plans[0]
    labels = cap.labels("cpu")
    saved_nodes = {labels.names[int(n)].split(":", 1)[1]
                   for n, c in zip(labels.node, labels.category, strict=True) if c == Category.SAVED_ACTIVATION}
    tensor_saved = {n for n in plan.saved if not n.startswith("primals") and plan.forward.by_name[n].dtype}
    assert saved_nodes and saved_nodes <= tensor_saved


def test_bert_dropout_masks_and_plan(bert: tuple[memprof.Capture, list[str]]) -> None:
    cap, lines = bert
    plan = cap.plans[0]
    _check_plan_against_partitioner_log(plan, lines)
    assert plan.random_ops and not plan.recomputed_random  # budget 1.0 saves the masks
    assert plan.masks and set(plan.masks) <= set(plan.saved)
    labels = cap.labels("cpu")
    assert all(c.level == "buffer" for c in labels.calls)
    masks = [labels.names[int(n)] for n, c in zip(labels.node, labels.category, strict=True) if c == Category.RNG_MASK]
    assert masks and all(m.split(":", 1)[1] in set(plan.masks) | set(plan.random_ops) for m in masks)
    _assert_rows_sum(cap)


def test_capture_file_keeps_plans_and_attribution(llama: tuple[memprof.Capture, list[str]], tmp_path: Path) -> None:
    cap, _ = llama
    path = cap.save(tmp_path / "run.memprof")
    again = memprof.load(path)
    assert [p.saved for p in again.plans] == [p.saved for p in cap.plans]
    assert [g.source for g in again.graphs] == [g.source for g in cap.graphs]
    assert again.attribution(by="node", device="cpu") == cap.attribution(by="node", device="cpu")
    res = invoke_memprof("report", str(path), "--by", "layer", "--at", "step:2", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["bytes"] == cap.peak("cpu", step=2) == sum(r["bytes"] for r in doc["rows"])
    res = invoke_memprof("report", str(path), "--by", "category", cwd=tmp_path)
    assert res.returncode == 0 and "saved_activation" in res.stdout and "recomputed" in res.stdout
    for bad, message in ((["--by", "node", "--at", "step:99"], "no step 99"),
                         (["--by", "node", "--at", "later"], "bad point 'later'"),
                         (["--at", "step:1"], "need --by"),
                         (["--by", "node", "--device", "cuda:3"], "no allocations on cuda:3")):
        res = invoke_memprof("report", str(path), *bad, cwd=tmp_path)
        assert res.returncode != 0 and "Traceback" not in res.stderr
        assert res.stderr.strip().startswith("memprof: error:") and message in res.stderr, res.stderr


def test_capture_from_before_plans_still_reports(llama: tuple[memprof.Capture, list[str]], tmp_path: Path) -> None:
    cap, _ = llama
    new = cap.save(tmp_path / "new.memprof")
    old = tmp_path / "old.memprof"
    with zipfile.ZipFile(new) as src, zipfile.ZipFile(old, "w") as dst:
        for item in src.namelist():
            if item == "plans.json" or item.startswith("wrappers/"):
                continue
            data = src.read(item)
            if item == "meta.json":
                meta = json.loads(data)
                meta["format_version"] = 1
                data = json.dumps(meta).encode()
            dst.writestr(item, data)
    legacy = memprof.load(old)
    assert legacy.plans == [] and legacy.graphs == []
    rows = legacy.attribution(by="category", device="cpu")
    assert sum(r.bytes for r in rows) == cap.peak("cpu")
    assert {c.level for c in legacy.labels("cpu").calls} == {"kernel"}
    res = invoke_memprof("report", str(old), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "attributed at kernel level only: 4 (4x no compile plan" in res.stderr + res.stdout


def test_chrome_export_has_category_counters_and_fx_nodes(llama: tuple[memprof.Capture, list[str]]) -> None:
    from memprof.reporters.chrome import chrome_trace, validate_chrome_trace

    cap, _ = llama
    trace = chrome_trace(cap)
    assert validate_chrome_trace(trace) == []
    counters = [e for e in trace["traceEvents"] if e.get("name") == "by category"]
    peak = max(sum(e["args"].values()) for e in counters)
    assert peak == cap.peak("cpu")
    named = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "fx_nodes" in e.get("args", {})]
    assert any(e["name"] == "aten::mm" and re.search(r"\bmm(_\d+)?\b", e["args"]["fx_nodes"]) for e in named)


def test_eager_capture_attributes_by_scope() -> None:
    torch.manual_seed(0)
    with memprof.capture() as cap:
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        x = torch.randn(32, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    rows = cap.attribution(by="category", device="cpu")
    assert sum(r.bytes for r in rows) == cap.peak("cpu")
    seen = {CATEGORIES[c] for c in np.unique(cap.labels("cpu").category)}
    assert {"parameter", "gradient", "optimizer_state", "saved_activation"} <= seen
    assert cap.plans == [] and cap.labels("cpu").calls == []


class _LM(torch.nn.Module):
    """A language model that returns its logits beside its loss (as Hugging Face's and nanoGPT's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4096, 64)
        self.head = torch.nn.Linear(64, 4096, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.tanh(self.emb(ids)))
        return torch.nn.functional.cross_entropy(logits.view(-1, 4096), ids.view(-1)), logits


def test_zeros_for_an_output_no_loss_used_are_named_at_the_peak() -> None:
    """A compiled model that returns its logits beside its loss is handed zeros the size of the
    logits as their gradient in every backward (autograd's materialized gradients); a compiled
    function that returns the loss alone is handed none. Named, and counted at the peak."""
    from memprof.analysis.summary import summarize
    from memprof.analysis.zero_grads import ZERO_GRAD_NODE
    from memprof.reporters.text import format_summary

    torch.manual_seed(0)
    model, ids = _LM(), torch.randint(0, 4096, (4, 64))
    logits_bytes = 4 * 64 * 4096 * 4
    for returns_logits in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(model if returns_logits else lambda i: model(i)[0], backend="aot_eager")
        with memprof.capture() as cap:
            for _ in range(2):
                out = fn(ids)
                (out[0] if returns_logits else out).backward()
                model.zero_grad(set_to_none=True)
        labels, tl = cap.labels("cpu"), cap.timeline("cpu")
        named = [i for i, n in enumerate(labels.names) if n == ZERO_GRAD_NODE]
        made = np.flatnonzero(tl.is_alloc & np.isin(labels.node, named))
        summary = summarize(cap)
        if returns_logits:
            assert tl.delta_at(made).tolist() == [logits_bytes] * 2
            assert summary.devices[0].zero_grads_at_peak == logits_bytes
            assert "returns only the loss makes none" in format_summary(summary)
        else:
            assert len(made) == 0 and summary.devices[0].zero_grads_at_peak == 0


def test_outputs_the_script_holds_through_the_backward_are_named_at_the_peak() -> None:
    """`loss, logits = step(ids)` keeps the logits through the backward; at budget 0 no backward saves
    them, so at the backward's peak they are memory the script holds and nothing reads: counted,
    with their FX node. Deleted before the backward, they are gone from it (the loss alone is under
    the share worth a line)."""
    import torch._functorch.config as functorch_config

    from memprof.analysis.summary import summarize

    torch.manual_seed(0)
    model, ids = _LM(), torch.randint(0, 4096, (4, 64))
    torch._dynamo.reset()
    step = torch.compile(model)
    held: dict[bool, tuple[int, list[str]]] = {}
    with functorch_config.patch(activation_memory_budget=0.0):
        for keep in (True, False):
            with memprof.capture() as cap:
                for _ in range(2):
                    loss, logits = step(ids)
                    if not keep:
                        del logits
                    loss.backward()
                    model.zero_grad(set_to_none=True)
                    del loss
            d = summarize(cap).devices[0]
            held[keep] = (d.held_outputs_at_peak, d.held_output_nodes)
    # the logits (fp32) and the loss the backward starts from (4 B: under the share that is named)
    assert held[True][0] == 4 * 64 * 4096 * 4 + 4 and len(held[True][1]) == 1 and held[True][1][0].startswith("fw0:")
    assert held[False] == (0, [])


def _bf16_lm_capture(seq: int = 64) -> memprof.Capture:
    """Three steps of `_LM` compiled under the CPU's bf16 autocast (the cross entropy on fp32
    logits, as transformers computes it)."""
    torch.manual_seed(0)
    model, ids = _LM(), torch.randint(0, 4096, (4, seq))
    torch._dynamo.reset()
    step = torch.compile(lambda i: torch.nn.functional.cross_entropy(model(i)[1].view(-1, 4096).float(), i.view(-1)))
    with memprof.capture() as cap:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = step(ids)
            loss.backward()
            model.zero_grad(set_to_none=True)
            memprof.step()
    return cap


def _estimate_line(cap: memprof.Capture) -> str:
    from memprof.analysis.summary import summarize
    from memprof.reporters.text import format_summary

    return next(ln for ln in format_summary(summarize(cap)).splitlines() if ln.startswith("step peak above"))


def test_the_cpus_half_precision_matmuls_accumulators_are_in_the_estimate() -> None:
    """On the CPU a bf16 matrix multiply allocates a float accumulator of its own inside the
    compiled graph's call, beside the output the wrapper code made: allocations the wrapper does not
    show. memprof measures each call signature once (`memprof.sweep.probe`) and counts it where the
    wrapper calls the kernel: the estimate equals the measured step to the byte."""
    cap = _bf16_lm_capture()
    specs = [n.name for p in cap.plans for n in (*p.forward.nodes, *p.backward.nodes) if n.call]
    assert specs == ["mm", "mm_1", "mm_2"], specs  # the forward's matmul and the backward's two
    unseen = [c.unseen for c in cap.labels("cpu").calls]
    assert unseen[:2] == [0, 0] and all(u > 0 for u in unseen[2:]), unseen  # (the first calls open op scopes)
    line = _estimate_line(cap)
    assert "(+0 B, +0.00%)" in line and "does not show" not in line, line


def test_an_estimate_that_cannot_count_a_librarys_own_buffers_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a kernel's own buffers are not measured (here the matmuls' accumulators, their probes
    turned off as for an op memprof does not probe), the estimate cannot count them: the summary's
    estimate line says so where it is off."""
    import memprof.torch_hooks.plan_recorder as recorder

    monkeypatch.setattr(recorder, "probed", lambda n, fallbacks: n.op == "call_function" and n.target in fallbacks)
    # (another length than the test above's: a graph of its own, not the plan memprof kept for that one)
    line = _estimate_line(_bf16_lm_capture(seq=32))
    assert "4 compiled-graph calls made allocations the wrapper code does not show" in line, line


def test_dropout_recomputed_below_budget_one_is_flagged(tmp_path: Path) -> None:
    """At budget 0.0 this BERT's backward draws the graph's seeds anew, so every mask differs from
    the forward's (its gradients are 7.8% off budget 1.0's with the same seed; at 0.05 the seeds are
    saved, the masks are recomputed from them, the gradients are budget 1.0's and nothing is flagged:
    test_remat.py checks the flag against the gradients)."""
    res = run_memprof("trace", str(ROOT / "examples" / "train_bert.py"), "--budget", "0.0", "--steps", "1",
                      "-o", "bert.memprof", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "WARNING: compiled graph 0 (inductor, activation_memory_budget=0) recomputes" in res.stderr
    assert "inductor_seeds" in res.stderr and "#190758" in res.stderr
    assert "by category:" in res.stderr
    cap = memprof.load(tmp_path / "bert.memprof")
    assert cap.plans[0].recomputed_random
    assert all(p.startswith("inductor_seed") for p in cap.plans[0].recomputed_random)
    res = invoke_memprof("report", "bert.memprof", "--by", "node", cwd=tmp_path)
    assert res.returncode == 0 and "WARNING" in res.stdout



def test_every_scope_mode_joins_every_compiled_graph_call_alike() -> None:
    """Inductor opens its call scope only under the profiler flag, which also makes it open one per
    kernel launch; memprof opens one of the same name itself, in `scopes="graphs"` (a user scope, no
    op scope) and in the default (op scopes, no kernel scope). Every call is joined buffer by buffer
    in each mode, the first call included (AOTAutograd runs it under a dispatch mode), and the
    categories, FX nodes and kernels equal those of the capture with Inductor's kernel scopes
    (`kernels=True`): the wrapper code names each buffer's kernel, no scope per launch is needed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    rows: dict[tuple[str, bool], dict[str, dict[str, int]]] = {}
    for scopes, kernels in (("graphs", False), ("ops", False), ("ops", True)):
        torch._dynamo.reset()
        step = torch.compile(model)
        with memprof.capture(scopes=scopes, kernels=kernels) as cap:
            for _ in range(2):
                step(x).sum().backward()
                model.zero_grad(set_to_none=True)
        calls = cap.labels("cpu").calls
        assert len(calls) == 4 and all(c.level == "buffer" for c in calls), (scopes, [c.reason for c in calls])
        rows[scopes, kernels] = {by: {r.key: r.bytes for r in cap.attribution(by=by, device="cpu")}
                                 for by in ("category", "node", "kernel")}
        names = {cap.scope_name(int(s)) for s in np.unique(cap.raw["scope"][cap.raw["kind"] == 2])}
        assert any(n.startswith("## Call CompiledFxGraph") for n in names), names
        assert any(n.startswith("aten::") for n in names) == (scopes == "ops"), names
        # op scopes inside a graph's second call only with Inductor's kernel scopes: without them it
        # runs quiet (its matmuls write into the wrapper's buffers, the join needs no scope of theirs)
        inside = _scopes_in_calls(cap)
        assert [bool(s) for s in inside] == [scopes == "ops"] * 2 + [kernels] * 2, inside
        if not kernels:  # (with them, Inductor's CPU wrapper opens no scope per C++ kernel either)
            assert not any(n.startswith(("cpp_fused", "triton_")) for n in names), names
    assert rows["ops", False] == rows["ops", True]
    # without op scopes, eager allocations are named "(no scope)"; the compiled graphs' are the same
    graphs, ops = rows["graphs", False], rows["ops", False]
    assert graphs["category"] == ops["category"]
    compiled = {k: v for k, v in ops["node"].items() if k.startswith(("fw", "bw"))}
    assert compiled and {k: v for k, v in graphs["node"].items() if k.startswith(("fw", "bw"))} == compiled
    assert "saved_activation" in rows["ops", False]["category"]
    assert any(k.startswith("cpp_fused") for k in rows["ops", False]["kernel"]), rows["ops", False]["kernel"]


def test_a_tensor_the_collector_frees_inside_the_backward_is_not_a_saved_activation() -> None:
    """A tensor held in a reference cycle dies when a collection happens to run. When that is inside
    the backward, the backward did not free it: it is not a saved activation. (Before, it was one: a
    model output held in a cycle and collected during the backward would be labelled so, as
    `test_saved_activations_are_the_forward_outputs_kept_for_backward` saw in CI runs, whose
    capture was not kept to confirm it.)"""
    import gc

    from memprof.analysis.attribution import Category

    x = torch.randn(64, 64, requires_grad=True)
    with memprof.capture() as cap:
        class Holder:
            pass

        h = Holder()
        h.me, h.t = h, torch.ones(1000)  # a cycle holding 4,000 B
        del h
        y = x * 2
        y.register_hook(lambda g: (gc.collect(), g)[1])  # a collection inside the backward
        (y * y).sum().backward()
    tl, labels, raw = cap.timeline("cpu"), cap.labels("cpu"), cap.raw
    sizes = raw["bytes"][tl.rows]
    held = [int(p) for p in np.flatnonzero(tl.is_alloc & (sizes == 4000))]
    assert len(held) == 1 and int(tl.free_of[held[0]]) in set(cap.gc_freed("cpu").tolist())
    # made before any compiled call or backward and never freed by the backward: an input
    assert labels.category[held[0]] == Category.INPUT
