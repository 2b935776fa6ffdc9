"""memprof sweep: budget specs, non-monotone detection on synthetic curves, and a real sweep of a
small model end to end (table, sweep.json, plot, flags, diagnosis, a failing budget)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import memprof
from memprof.errors import MemprofError
from memprof.sweep import load_sweep, non_monotone, parse_budgets, spearman, worst_per_budget
from memprof.sweep.detect import tolerance
from memprof.sweep.measure import measure
from memprof.sweep.runner import group_tasks
from memprof.sweep.spec import budget_label

from ..conftest import ROOT, invoke_memprof, one_line_error, run_memprof

MB = 1_000_000


def test_budget_specs() -> None:
    assert parse_budgets("0.05,0.1,0.3") == [0.05, 0.1, 0.3]
    assert parse_budgets("0.3, 0.05,0.05") == [0.05, 0.3]
    grid = parse_budgets("0.05:0.30:0.01")
    assert len(grid) == 26 and grid[0] == 0.05 and grid[-1] == 0.3 and grid[2] == 0.07
    assert parse_budgets("0.0:0.3:0.1,1.0") == [0.0, 0.1, 0.2, 0.3, 1.0]
    assert parse_budgets("0:0.25:0.1") == [0.0, 0.1, 0.2]  # STOP only when a step reaches it


@pytest.mark.parametrize("spec, message", [
    ("", "empty"), ("  ", "empty"), ("0.1,,0.2", "empty item"), ("1.5", "outside [0, 1]"), ("-0.1", "outside"),
    ("0:0.3:0", "step must be > 0"), ("0:0.3:-0.1", "step must be > 0"), ("0.3:0.1:0.1", "below START"),
    ("abc", "not a number"), ("0.1:0.2", "START:STOP:STEP"), ("nan", "finite"), ("0:1:0.0000001", "at most"),
])
def test_malformed_budget_specs(spec: str, message: str) -> None:
    with pytest.raises(MemprofError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_budgets(spec)


def test_detection_on_synthetic_curves() -> None:
    # the H200 reference curve (shared/reference): 0.0-0.10 all above the 0.13 minimum, and 1.0 above all but 0.0
    ref = [(0.0, 1141.2), (0.05, 901.5), (0.10, 586.0), (0.13, 363.3), (0.15, 383.7), (0.20, 415.1),
           (0.30, 473.8), (1.0, 1110.2)]
    flags = non_monotone([(b, int(p * MB)) for b, p in ref])
    pairs = {(f.low, f.high) for f in flags}
    expected = {(a, b) for i, (a, pa) in enumerate(ref) for b, pb in ref[i + 1:] if pa > pb}
    assert pairs == expected
    worst = worst_per_budget(flags)
    assert [(f.low, f.high) for f in worst] == [(0.0, 0.13), (0.05, 0.13), (0.10, 0.13)]
    assert worst[1].excess == int(901.5 * MB) - int(363.3 * MB)
    # a monotone curve, a curve wiggling within the noise, and missing points
    assert non_monotone([(0.1, 500 * MB), (0.2, 600 * MB), (0.3, 700 * MB)]) == []
    assert non_monotone([(0.1, 190_400_000), (0.2, 189_800_000), (0.3, 189_200_000)]) == []  # rerun noise
    assert non_monotone([(0.1, None), (0.2, 100 * MB), (0.3, None)]) == []
    # the noise threshold: max(1.5 MB, 0.5%)
    assert tolerance(100 * MB) == 1_500_000 and tolerance(1000 * MB) == 5 * MB
    assert [(f.low, f.high) for f in non_monotone([(0.1, 101_600_000), (0.2, 100 * MB)])] == [(0.1, 0.2)]
    assert non_monotone([(0.1, 101_400_000), (0.2, 100 * MB)]) == []
    assert non_monotone([(0.1, 101_600_000), (0.2, 100 * MB)], abs_tol=2 * MB) == []


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [1, 3, 2, 5, 4]) == pytest.approx(0.8)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)  # ties: average ranks
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None


def test_process_threads() -> None:
    """Each sweep process gets cores / processes of Inductor's compile workers, and with a GPU of
    torch's CPU threads; a variable the user set is kept."""
    from memprof.sweep.runner import process_threads

    assert process_threads(16, 13, True, {}) == {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    assert process_threads(16, 4, False, {}) == {"TORCHINDUCTOR_COMPILE_THREADS": "4"}
    assert process_threads(2, 0, True, {"OMP_NUM_THREADS": "3"}) == {"TORCHINDUCTOR_COMPILE_THREADS": "2"}
    assert process_threads(2, 5, True, {"TORCHINDUCTOR_COMPILE_THREADS": "8", "OMP_NUM_THREADS": "3"}) == {}


def test_a_machine_without_a_gpu_driver_is_told_without_torch() -> None:
    """The sweep's and fit's parent process only starts others: on a machine with no GPU driver it
    learns that no GPU is visible (whatever CUDA_VISIBLE_DEVICES says) without importing torch."""
    from memprof.sweep.runner import GPU_DEVICE_FILES

    if any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        pytest.skip("a GPU driver is installed here")
    code = "import sys; from memprof.sweep.runner import visible_gpus; print(visible_gpus(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}).stdout
    assert out.split() == ["[]", "False"]


def test_predict_groups_budgets_into_processes() -> None:
    """Measured budgets run one per process; predicted ones share processes, as few budgets each as
    `jobs` allows and evenly (the largest group sets the wall time), a variant's budgets dealt
    round-robin, every budget exactly once, never two variants in one process."""
    budgets = [0.0, 0.1, 0.2, 0.3, 0.4]
    assert group_tasks(budgets, ["stock"], 2, share=False) == [("stock", [b]) for b in budgets]
    assert group_tasks(budgets, ["stock"], 2, share=True) == [("stock", [0.0, 0.2, 0.4]), ("stock", [0.1, 0.3])]
    assert group_tasks(budgets, ["stock"], 9, share=True) == [("stock", [b]) for b in budgets]
    assert group_tasks(budgets, ["stock"], 4, share=True) == [  # 2 each: 3 processes, not 4 of 2, 1, 1, 1
        ("stock", [0.0, 0.3]), ("stock", [0.1, 0.4]), ("stock", [0.2])]
    paper = group_tasks([i / 100 for i in range(25)] + [1.0], ["stock"], 16, share=True)
    assert len(paper) == 13 and {len(bs) for _, bs in paper} == {2}
    two = group_tasks(budgets, ["stock", "light"], 4, share=True)
    assert [(v, len(bs)) for v, bs in two] == [("stock", 3), ("stock", 2), ("light", 3), ("light", 2)]
    for v in ("stock", "light"):
        assert sorted(b for w, bs in two if w == v for b in bs) == budgets
    assert group_tasks(budgets, ["stock", "light", "all"], 1, share=True) == [
        ("stock", budgets), ("light", budgets), ("all", budgets)]


def test_predictions_out_of_device_memory_are_predicted_again_alone(tmp_path: Path) -> None:
    """After a shared pass, each budget that ran out of device memory runs again on its own; the
    shared attempt's log is kept and the sweep says what the second attempt found."""
    from memprof.sweep.result import Run, Sweep
    from memprof.sweep.runner import _again_alone, out_of_device_memory

    def run(budget: float, status: str, error: str | None = None) -> Run:
        return Run("stock", budget, status, 0 if status == "completed" else 1, error, None,
                   f"logs/stock_{budget_label(budget)}.log", 1.0)

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "stock_0.100.log").write_text("shared attempt")
    cublas = run(0.2, "exception", "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
    sweep = Sweep(command=["s.py"], budgets=[0.05, 0.1, 0.2], variants=["stock"],
                  runs=[run(0.05, "completed"), run(0.1, "oom", "OutOfMemoryError"), cublas], mode="predict")
    assert [out_of_device_memory(r) for r in sweep.runs] == [False, True, True]
    asked: list[tuple[str, list[float]]] = []

    def rerun(variant: str, budgets: list[float]) -> list[Run]:
        asked.append((variant, budgets))
        return [run(budgets[0], "oom", "OutOfMemoryError")]

    _again_alone(sweep, tmp_path, rerun)
    assert asked == [("stock", [0.1]), ("stock", [0.2])]
    assert sorted(r.budget for r in sweep.runs) == [0.05, 0.1, 0.2]
    assert (tmp_path / "logs" / "stock_0.100.shared.log").read_text() == "shared attempt"
    assert sweep.notes == ["2 budget(s) ran out of device memory while the sweep's processes shared it and were "
                           "predicted again alone: 0 then completed; the others do not fit on the device by themselves"]


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    for spec, needle in [("", "empty"), ("0.1:0.3:0", "step must be > 0"), ("2", "outside [0, 1]")]:
        assert needle in one_line_error(invoke_memprof("sweep", "train.py", "--budgets", spec, cwd=tmp_path))
    assert "does not exist" in one_line_error(invoke_memprof("sweep", "nope.py", "--budgets", "0.1", cwd=tmp_path))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sweep.json").write_text("{}")
    line = one_line_error(invoke_memprof("sweep", "train.py", "--budgets", "0.1", "-o", "out", cwd=tmp_path))
    assert "exists" in line and "--force" in line
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    line = one_line_error(invoke_memprof("sweep", "train.py", "--budgets", "0.1", "-o", "other", "--force",
                                       cwd=tmp_path))
    assert "not written by memprof sweep" in line and (tmp_path / "other" / "notes.txt").exists()


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A real sweep: TinyLlama (6 layers) under aot_eager, 4 budgets, 2 at a time; budget 0.0 crashes."""
    tmp = tmp_path_factory.mktemp("sweep")
    shutil.copy(ROOT / "tests" / "sweep_train.py", tmp / "sweep_train.py")
    shutil.copy(ROOT / "tests" / "remat_models.py", tmp / "remat_models.py")
    res = run_memprof("sweep", "sweep_train.py", "--budgets", "0.0,0.02,0.1,1.0", "--jobs", "2", "-o", "out",
                      "--crash-below", "0.01", cwd=tmp, timeout=900)
    return tmp / "out", res


@pytest.mark.slow
def test_sweep_end_to_end(small_sweep: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, res = small_sweep
    assert res.returncode == 0, res.stderr[-3000:]
    sweep = load_sweep(out)
    assert [r.budget for r in sweep.runs] == [0.0, 0.02, 0.1, 1.0] and sweep.variants == ["stock"]
    crashed = sweep.runs[0]
    assert crashed.status == "exception" and not crashed.ok and "deliberate failure" in (crashed.error or "")
    assert crashed.capture is not None and (out / crashed.capture).exists()  # the partial capture is kept
    for r in sweep.runs[1:]:
        assert r.ok and r.measured is not None and r.measured.compiled and r.measured.steps == 3
        # the step peak is exact: recomputed here from the capture's own timeline
        assert r.capture is not None
        cap = memprof.load(out / r.capture)
        m = measure(cap, attribution=False)
        assert m.step_peak == r.step_peak and m.step_peaks == r.measured.step_peaks
        tl = cap.timeline("cpu")
        assert r.step_peak is not None and 0 < r.step_peak <= tl.peak - tl.baseline
    # the knapsack at 0.02 recomputes more and peaks higher than at 0.1: flagged and explained
    flags = {(f.low, f.high) for f in sweep.flags()}
    assert (0.02, 0.1) in flags
    peaks = {r.budget: r.step_peak for r in sweep.runs}
    assert all(peaks[a] > peaks[b] for a, b in flags if peaks[a] and peaks[b])  # type: ignore[operator]
    diag = {d.low: d for d in sweep.diagnoses()}
    text = "\n".join(diag[0.02].lines)
    assert "selection:" in text and "recomputes" in text and "lifetime:" in text
    f02, f10 = sweep.runs[1].facts, sweep.runs[2].facts
    assert f02 is not None and f10 is not None
    assert f02.saved_bytes < f10.saved_bytes and f02.recomputed_bytes > f10.recomputed_bytes
    # terminal output, json, plot
    assert "| 0.02" in res.stdout and "EXCEPTION" in res.stdout and "more than 0.1" in res.stdout
    assert "less budget, more memory" in res.stdout
    d = json.loads((out / "sweep.json").read_text())
    assert d["analysis"]["stock"]["flags"] and d["analysis"]["stock"]["diagnoses"]
    # the in-tree KnapsackEvaluator's peak for each knapsack plan (0.02 and 0.1; aot_eager has no wrapper code)
    scores = d["analysis"]["stock"]["estimators"]
    assert scores["knapsack evaluator"]["budgets"] == 2 and scores["memprof"]["budgets"] == 0
    for ext in ("png", "svg"):
        assert (out / f"sweep.{ext}").stat().st_size > 10_000
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    page = (out / "sweep.html").read_text()  # the plot, the table and the findings, offline
    assert "<svg" in page and "less budget, more memory" in page and "| 0.02" in page
    assert not re.search(r"""(src|href)=["']https?:""", page) and "<script" not in page
    assert "4/4" in res.stderr


@pytest.mark.slow
def test_sweep_of_a_script_that_never_compiles(tmp_path: Path) -> None:
    shutil.copy(ROOT / "tests" / "sweep_train.py", tmp_path / "sweep_train.py")
    shutil.copy(ROOT / "tests" / "remat_models.py", tmp_path / "remat_models.py")
    res = run_memprof("sweep", "sweep_train.py", "--budgets", "0.1,0.5", "--jobs", "2", "--no-plot", "--eager",
                      "--layers", "2", "--steps", "2", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "never called torch.compile" in res.stdout
    sweep = load_sweep(tmp_path / "sweep_sweep_train")
    peaks = [r.step_peak for r in sweep.runs]
    assert all(p is not None and p > 0 for p in peaks)
    assert np.ptp(np.array(peaks)) == 0  # eager: the budget changes nothing, to the byte
    assert not any(r.measured is not None and r.measured.compiled for r in sweep.runs)
    # the cores are split between the jobs for Inductor's compile workers; on the CPU torch keeps its
    # threads (Inductor's CPU code depends on their number)
    log = (tmp_path / "sweep_sweep_train" / sweep.runs[0].log).read_text()
    threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") or max(1, (os.cpu_count() or 1) // 2)
    assert f"compile threads {threads}" in log, log[-2000:]
    import torch

    if not torch.cuda.is_available():
        assert f"cpu threads {torch.get_num_threads()}" in log, log[-2000:]


WRAPPER_FW = '''
def call(self, args):
    primals_1, primals_2 = args
    args.clear()
    buf0 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    extern_kernels.mm(primals_1, primals_2, out=buf0)
    buf1 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    cpp_fused_relu_0(buf0, buf1)
    # Topologically Sorted Source Nodes: [attn], Original ATen: [aten._scaled_dot_product_flash_attention_for_cpu]
    buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf1, buf1, buf1)
    buf3 = buf2[0]
    buf4 = buf2[1]
    del buf2
    buf5 = reinterpret_tensor(buf0, (64, 64), (64, 1), 0); del buf0  # reuse
    cpp_fused_add_1(buf3, buf5)
    del buf3
    return (buf5, primals_1, buf1, buf4, )
'''


def test_wrapper_walk_is_exact_on_a_known_program() -> None:
    from memprof.plans import FxGraph, FxNode
    from memprof.sweep.estimate import walk_wrapper

    attn = FxNode("_scaled_dot_product_flash_attention_for_cpu", "call_function",
                  "aten._scaled_dot_product_flash_attention_for_cpu.default", None, None, 16384 + 256, [], "", "attn")
    w = walk_wrapper(WRAPPER_FW, FxGraph([attn]))
    # buf0 16384, buf1 16384, then the attention's tuple (out 16384 + logsumexp 256) from its FX node
    assert w.peak == 16384 * 3 + 256 and w.unknown == ()
    # buf3 is dropped, but it shares the tuple's storage with buf4 (returned): nothing is freed early
    assert w.end == 16384 * 3 + 256
    assert w.outputs[1] is None and len({o for o in w.outputs if o is not None}) == 3
    # on CUDA each storage is rounded up to 512-byte blocks
    assert walk_wrapper(WRAPPER_FW, FxGraph([attn]), block=512).peak == 16384 * 3 + 512
    # an owned input is freed at its del; a resident one costs nothing
    owned = walk_wrapper("def call(self, args):\n    a, b = args\n    buf0 = empty_strided_cpu((8, ), (1, ), "
                         "torch.float32)\n    del a\n    buf1 = empty_strided_cpu((8, ), (1, ), torch.float32)\n"
                         "    return (buf0, buf1, )\n", None, {"a": (-1, 100)})
    assert owned.peak == 100 + 32 and owned.end == 64
    # a fallback kernel's scratch: its call peaks that much above the live bytes with its outputs
    spiked = walk_wrapper(WRAPPER_FW, FxGraph([attn]), scratch={attn.name: 40000}, explain=True)
    assert spiked.peak == 16384 * 2 + 16384 + 256 + 40000 and spiked.end == w.end
    assert ("scratch of _scaled_dot_product_flash_attention_for_cpu (_scaled_dot_product_flash_attention_for_cpu)",
            40000) in spiked.at_peak
    assert sum(b for _, b in spiked.at_peak) == spiked.peak


def test_probe_measures_a_fallback_kernels_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU attention backward allocates above its three gradients while it runs; the probe
    measures that on placeholder inputs from the call spec recorded at partition time, and leaves
    the RNG as it was. A call it cannot measure is named, with why, for the estimate's note."""
    import json
    from types import SimpleNamespace

    import torch

    import memprof._native
    from memprof.sweep.probe import scratch_bytes, unprobed
    from memprof.torch_hooks.fx import call_spec

    graph = torch.fx.Graph()
    g, q, k, v, o, lse = (graph.placeholder(name) for name in ("g", "q", "k", "v", "o", "lse"))
    for n in (g, q, k, v, o):
        n.meta["val"] = torch.empty(2, 4, 64, 16)
    lse.meta["val"] = torch.empty(2, 4, 64)
    call = graph.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                               (g, q, k, v, o, lse, 0.0, True))
    spec = call_spec(call)
    d = json.loads(spec)
    assert d["op"] == "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default"
    assert d["args"][0] == {"t": [[2, 4, 64, 16], [4096, 1024, 16, 1], "float32", "cpu", 0]}
    assert d["args"][6:] == [0.0, True]
    state = torch.get_rng_state()
    scratch = scratch_bytes(spec)
    assert torch.equal(state, torch.get_rng_state())
    assert scratch is not None and scratch > 0
    assert scratch_bytes(spec) == scratch  # measured once per signature
    # a call memprof cannot run (unknown op) has no scratch, and no failure
    unknown = json.dumps({"op": "aten::no_such_op.default", "args": [], "kwargs": {}})
    assert scratch_bytes(unknown) is None
    # never inside the user's capture
    inside = spec.replace("0.0, true", "0.0, false")
    with memprof.capture():
        assert scratch_bytes(inside) is None
    # without the native extension nothing is measured
    no_native = spec.replace("0.0, true", "0.5, true")

    def unbuilt() -> None:
        raise memprof.NativeUnavailable("not built")

    monkeypatch.setattr(memprof._native, "native", unbuilt)
    assert scratch_bytes(no_native) is None
    nodes = [SimpleNamespace(call=c) for c in (spec, unknown, inside, no_native, unknown, "")]
    assert unprobed(nodes) == [("aten::no_such_op.default", "it failed on placeholder inputs (AttributeError)"),
                               (d["op"], "a capture was running"), (d["op"], "memprof's native extension is not built")]


def test_the_wrap_up_after_the_last_step_is_not_a_step() -> None:
    """Optimizer steps end the steps; what the script does after the last one runs no compiled
    forward and is no step. Measured as one, its rise of nearly nothing was the median of two steps'
    (a 2-step trace printed a step peak of 0.0 MB beside an estimate of 218 MB)."""
    import torch

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = torch.compile(model, backend="aot_eager")
    x = torch.randn(32, 64)
    with memprof.capture() as cap:
        for _ in range(2):
            fn(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        wrap_up = torch.zeros(16)  # (the script's own end: a small allocation, no compiled forward)
    del wrap_up
    torch._dynamo.reset()
    m = measure(cap, attribution=False)
    assert m.step_source == "markers" and m.steps == 2
    # the second step's rise alone (with the wrap-up it was the median of [172,040, 64]: 64 B)
    assert len(m.step_peaks) == 1 and m.step_peak == m.step_peaks[0] > 32 * 256 * 4  # the hidden activation


@pytest.mark.slow
def test_memprof_estimate_on_inductor_cpu() -> None:
    """A compiled TinyLlama step on CPU: memprof's wrapper walk, with the attention kernels' scratch
    probed, predicts the measured step peak within 0.5% at budgets 0 and 1 (without the probe it
    misses the CPU attention backward's own buffers, 2% at budget 1), and explains its peak as the
    capture's attribution does."""
    import sys

    import torch
    import torch._functorch.config as functorch_config

    sys.path.insert(0, str(ROOT / "tests"))
    from remat_models import TinyLlama, projection_loss  # type: ignore[import-not-found]

    results = {}
    for budget in (0.0, 1.0):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyLlama(layers=2, d=64, heads=4, mlp=172, vocab=128)
        ids = torch.randint(0, 128, (2, 64))
        fn = torch.compile(model)
        with functorch_config.patch(activation_memory_budget=budget), memprof.capture() as cap:
            for _ in range(3):
                projection_loss(fn(ids)).backward()
                model.zero_grad(set_to_none=False)
        m = measure(cap)
        assert m.step_source == "forward graph calls" and m.steps == 3
        # the estimate explained: its peak is where the capture's is, and what is live there agrees
        # with the capture's attribution (recomputed values at budget 0, saved activations at 1)
        assert m.estimate_peak_phase == m.peak_phase == "backward"
        key = "recomputed" if budget == 0.0 else "saved_activation"
        assert m.at_peak[key] > 0 and abs(m.estimate_at_peak[key] - m.at_peak[key]) <= 0.01 * m.at_peak[key]
        assert sum(m.estimate_at_peak.values()) == m.estimates["memprof"]
        est = m.estimates["memprof"]
        assert est is not None and m.step_peak is not None
        results[budget] = (est, m.step_peak)
        assert abs(est - m.step_peak) <= 0.005 * m.step_peak, (budget, est, m.step_peak)
        assert any(n.call for p in cap.plans for n in p.backward.nodes)  # the attention backward's call
    # less saved at budget 0: both the estimate and the measurement say which budget peaks higher
    (e0, m0), (e1, m1) = results[0.0], results[1.0]
    assert (e0 > e1) == (m0 > m1)


def test_the_estimate_holds_the_tangents_a_capture_saw_outlive_the_backward() -> None:
    """A compiled MLP's step, its loss `.sum()` or its output's backward given a gradient the script
    holds: the capture sees which tangent outlived the compiled backward's call (none: AOTAutograd's
    contiguous copy of `.sum()`'s expanded ones is freed at the wrapper's `del`; `tangents_1`: the
    script's own gradient), and the estimate holds it through the backward as the run did, where
    torch's version alone (2.13: every tangent freed at its `del`) would not."""
    import torch

    from memprof.sweep.step_estimate import estimate_capture_plans

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    x = torch.randn(64, 256)
    out_bytes = 64 * 512 * 4
    found = {}
    for given in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(model)
        with memprof.capture() as cap:
            for _ in range(3):
                if given:
                    out = fn(x)
                    out.backward(torch.ones_like(out))  # (the script holds `out` through its backward)
                    del out
                else:
                    fn(x).sum().backward()
                model.zero_grad(set_to_none=False)
        m = measure(cap)
        assert m.step_peak is not None and m.estimates["memprof"] is not None
        by_version = estimate_capture_plans(cap.plans, cap.graphs, "cpu", probe=False, torch_version="2.13.0")
        assert by_version is not None
        found[given] = (cap.info.tangents_kept, m.step_peak, int(m.estimates["memprof"]), by_version.peak)
    assert found[False][0] == {0: ()} and found[True][0] == {0: ("tangents_1",)}
    _, measured, est, by_version = found[False]
    assert est == by_version and measured - est == 8  # (the loss, a scalar the compiled graphs do not make)
    _, measured, est, by_version = found[True]
    assert est == by_version + out_bytes and measured == est + out_bytes


def _predict(tmp_path: Path, budgets: list[float], *script_args: str, remat: str | None = None
             ) -> tuple[int, list[dict[str, Any]]]:
    """`memprof _sweep-child --predict` for budgets in one process, on tests/sweep_train.py."""
    paths = [tmp_path / f"{len(list(tmp_path.iterdir()))}_{i}.json" for i in range(len(budgets))]
    cmd = [sys.executable, "-m", "memprof", "_sweep-child", "--predict"]
    for b, path in zip(budgets, paths, strict=True):
        cmd += ["--budget", str(b), "--json", str(path)]
    cmd += ["--remat", remat] if remat else []
    cmd += [str(ROOT / "tests" / "sweep_train.py"), "--", "--layers", "2", "--d", "64", "--seq", "64", *script_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return proc.returncode, [json.loads(path.read_text()) for path in paths]


def test_predicted_budgets_share_a_process(tmp_path: Path) -> None:
    """Budgets predicted in one process get the plans each gets alone (aot_eager: the partitioner's
    choice, no wrapper code), with memprof's remat pass too; when the script fails before its
    backward, every budget of the process reports the failure, not a prediction with a region
    missing."""
    rc, shared = _predict(tmp_path, [0.0, 1.0, 0.3])
    assert rc == 0
    for b, got in zip([0.0, 1.0, 0.3], shared, strict=True):
        assert got["status"] == "completed" and got["details"]["group"] == [0.0, 1.0, 0.3]
        assert got["details"]["ran_script"] == (b == 0.0) and got["measured"]["plans"] == 1
        if b == 0.0:  # (the script ran with it: a process of its own but for the budgets compiled after)
            continue
        rc_alone, (alone,) = _predict(tmp_path, [b])
        assert rc_alone == 0 and alone["details"]["group"] == [b]
        assert got["measured"]["facts"] == alone["measured"]["facts"]
    assert shared[0]["measured"]["facts"] != shared[1]["measured"]["facts"]  # budgets 0 and 1 save differently
    rc, remat = _predict(tmp_path, [0.0, 0.3], remat="light")  # memprof's remat pass on the copied joint graph
    rc_alone, (remat_alone,) = _predict(tmp_path, [0.3], remat="light")
    assert rc == rc_alone == 0 and remat[1]["measured"]["facts"] == remat_alone["measured"]["facts"]
    assert remat[1]["measured"]["facts"] != shared[2]["measured"]["facts"]  # light is not stock
    rc, failed = _predict(tmp_path, [0.0, 1.0], "--crash-before-backward")
    assert rc == 1
    assert [f["status"] for f in failed] == ["exception", "exception"]
    assert failed[0]["error"] == "RuntimeError: deliberate failure before the backward"
    assert failed[1]["error"] == "RuntimeError: deliberate failure before the backward (the script, run with 0)"


ATTENTION_SCRIPT = """\
import torch


class Attention(torch.nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.heads = torch.nn.Linear(d, 3 * d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5
        probs = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), 0.1)
        return (probs @ v).transpose(1, 2).reshape(b, s, d)


step = torch.compile(Attention())
for _ in range(2):
    step(torch.randn(8, 64, 16)).sum().backward()
"""


def test_budgets_share_a_process_where_inductors_pattern_matcher_traces(tmp_path: Path) -> None:
    """Inductor's joint-graph pattern matcher traces an attention pattern's replacement with AOTAutograd
    (inside the region's compile, recording the graph in a partition function of its own): that
    nested call is compiled once, as it is, not once per budget (it failed every budget after the
    first with an AssertionError, the bundled BERT's included)."""
    script = tmp_path / "attention.py"
    script.write_text(ATTENTION_SCRIPT)
    paths = [tmp_path / "0.json", tmp_path / "1.json"]
    proc = subprocess.run([sys.executable, "-m", "memprof", "_sweep-child", "--predict", "--budget", "0",
                           "--json", str(paths[0]), "--budget", "1", "--json", str(paths[1]), str(script)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = [json.loads(p.read_text()) for p in paths]
    assert [g["status"] for g in got] == ["completed", "completed"]
    assert all(g["measured"]["plans"] == 1 and g["measured"]["estimates"]["memprof"] for g in got)
    assert got[0]["measured"]["facts"] != got[1]["measured"]["facts"]


def test_predicted_graphs_run_op_by_op() -> None:
    """Under `eager_runs`, a graph Inductor compiles runs op by op as it was before Inductor's
    passes: the function's values, no kernel compiled; a graph whose op-by-op run
    fails says so and runs its compiled code."""
    import torch
    import torch._inductor.config as inductor_config

    from memprof.torch_hooks.patch import Patches
    from memprof.torch_hooks.predict import EagerRun, LazyKernel, eager_runs, lazy_kernels

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w).sin() + x.sum()

    x, w = torch.randn(8, 8), torch.randn(8, 8)
    runs: list[EagerRun] = []
    kernels: list[LazyKernel] = []
    notes: list[str] = []
    torch._dynamo.reset()
    with Patches() as patches, inductor_config.patch(force_disable_caches=True):
        lazy_kernels(patches, kernels)
        eager_runs(patches, runs, notes.append)
        got = torch.compile(f, backend="inductor")(x, w)
    torch._dynamo.reset()
    torch.testing.assert_close(got, f(x, w))  # aten's ops as traced: the same values to rounding
    assert len(runs) == 1 and runs[0].eager_calls == 1 and notes == []
    assert kernels and not any(k.is_compiled for k in kernels)

    def failing(a: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no eager kernel")

    compiled_calls: list[int] = []

    def compiled(inputs: list[Any]) -> Any:
        compiled_calls.append(len(inputs))
        return (inputs[0] * 2,)

    run = EagerRun(failing, compiled, notes.append)
    args = [torch.ones(2)]
    assert torch.equal(run(args)[0], torch.full((2,), 2.0)) and compiled_calls == [1]
    assert notes == ["a compiled graph ran its compiled code: its op-by-op run failed (RuntimeError: no eager kernel)"]
    run([torch.ones(2)])
    assert compiled_calls == [1, 1] and len(notes) == 1 and run.eager_calls == 0


@pytest.mark.slow
def test_predict_draws_the_curve_without_a_training_step(tmp_path: Path) -> None:
    """--predict compiles each budget and stops at the first backward: no step runs, no capture is
    written, and its estimate for the budget compiled beside the script's matches the one a measured
    sweep derives from its own compile (within 0.1%: Inductor's code differs by a few bytes with the
    capture's profiler scopes on), and so lies within 3% of the measured step peak (budget 0, the
    one the script runs with, is measured against its estimate in test_memprof_estimate_on_inductor_cpu).
    With one job both budgets share one process (one script start, one Dynamo trace, one joint
    graph); the budget compiled beside the one the script ran with predicts to the byte what it
    predicts in a process of its own; no kernel is compiled in either (the script's forward runs op
    by op, its backward never)."""
    example = str(ROOT / "examples" / "train_llama.py")
    script_args = ["--", "--no-optimizer", "--steps", "2"]
    measured = run_memprof("sweep", example, "--budgets", "1.0", "--no-plot", "-o", "m", *script_args,
                           cwd=tmp_path, timeout=900)
    assert measured.returncode == 0, measured.stderr[-3000:]
    predicted = run_memprof("sweep", example, "--budgets", "0.0,1.0", "--no-plot", "--jobs", "1", "-o", "p",
                            "--predict", *script_args, cwd=tmp_path, timeout=900)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    if (os.cpu_count() or 1) > 1:  # one job for two budgets: the sweep says how to use the cores
        assert f"--jobs {min(2, os.cpu_count() or 1)} would spread them over the cores" in predicted.stderr
    alone = subprocess.run([sys.executable, "-m", "memprof", "_sweep-child", "--predict", "--budget", "1.0",
                            "--json",
                            str(tmp_path / "alone.json"), example, *script_args], cwd=tmp_path, capture_output=True,
                           text=True, timeout=900)
    assert alone.returncode == 0, alone.stderr[-3000:]
    m, p = load_sweep(tmp_path / "m"), load_sweep(tmp_path / "p")
    assert p.mode == "predict" and m.mode == "measure"
    assert not list((tmp_path / "p").glob("*.memprof"))
    log = f"stock_{budget_label(0.0)}+1.log"  # one process
    assert [f.name for f in (tmp_path / "p" / "logs").glob("*.log")] == [log]
    assert "step 1:" not in (tmp_path / "p" / "logs" / log).read_text()  # the script printed nothing after a backward
    (rm,) = m.runs
    for rp in p.runs:
        assert rp.ok and rp.measured is not None and rm.measured is not None
        est = rp.measured.estimates["memprof"]
        assert est is not None and p.value(rp) == est
        if rp.budget == rm.budget:
            assert abs(est - (rm.measured.estimates["memprof"] or 0)) <= 0.001 * est
            assert rm.step_peak is not None and abs(est - rm.step_peak) <= 0.03 * rm.step_peak
        # no capture: what is live at the peak is the estimate's own explanation, summing to it
        assert rp.measured.at_peak_source == "estimate" and rp.measured.peak_phase == "backward"
        assert sum(rp.measured.at_peak.values()) == est
        assert rp.measured.estimate_unprobed == rm.measured.estimate_unprobed == []  # every scratch probed
    at_zero = next(r for r in p.runs if r.budget == 0.0).measured
    assert at_zero is not None and at_zero.at_peak.get("recomputed", 0) > 0  # all recomputed at budget 0
    shared = json.loads((tmp_path / "p" / "logs" / f"stock_{budget_label(1.0)}.json").read_text())
    solo = json.loads((tmp_path / "alone.json").read_text())
    assert shared["details"]["group"] == [0.0, 1.0] and not shared["details"]["ran_script"]
    # no kernel is compiled: the budget the script ran with runs its graphs op by op
    assert shared["details"]["kernels"] > 0 and shared["details"]["kernels_compiled"] == 0
    assert solo["details"]["kernels"] > 0 and solo["details"]["kernels_compiled"] == 0
    assert solo["details"]["graphs_run_op_by_op"] > 0 and shared["details"]["graphs_run_op_by_op"] == 0
    for key in ("facts", "peak_phase", "plans"):
        assert shared["measured"][key] == solo["measured"][key], key
    # the estimates to the byte but for the CPU scratch probes' own variation between processes: a
    # fallback kernel's workspace was measured 128 B apart in one CI run under load (33,024 against
    # 32,896 B), visible since CPU predictions stopped rounding to CUDA's 512-byte blocks
    sm, om = shared["measured"], solo["measured"]
    assert sm["estimates"].keys() == om["estimates"].keys()
    for name, value in sm["estimates"].items():
        other = om["estimates"][name]
        assert (value is None and other is None) or abs(value - other) <= 512, name
    assert {k: v for k, v in sm["at_peak"].items() if k != "workspace"} == {
        k: v for k, v in om["at_peak"].items() if k != "workspace"}
    assert "predicted MB" in predicted.stdout


_HOLDS_LOGITS = '''\
import sys
import torch


class LM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(1024, 32)
        self.head = torch.nn.Linear(32, 1024, bias=False)

    def forward(self, ids):
        logits = self.head(torch.tanh(self.emb(ids)))
        return torch.nn.functional.cross_entropy(logits.view(-1, 1024), ids.view(-1)), logits


torch.manual_seed(0)
model = LM()
ids = torch.randint(0, 1024, (4, 64))
step = torch.compile(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    if sys.argv[1] == "hold":
        loss, logits = step(ids)  # the logits stay live until the next step's forward returns
    else:
        loss = step(ids)[0]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
'''


def test_a_prediction_reads_the_gradients_its_first_compiled_backward_would_get(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At its first backward a prediction runs the backward's eager part and stops where the first
    compiled region's backward would start, reading the gradients handed to it: `.sum()`'s is an
    expanded tensor (AOTAutograd copies it; the copy goes at the wrapper's `del`), `.mean()`'s a
    dense one (torch 2.11's engine holds it through the call). No gradient is accumulated. On a
    torch that holds tangents, the pair whose tangents match keeps only the dense ones."""
    import types

    import torch

    import memprof.sweep.predict as predict
    from memprof.torch_hooks.tangents import incoming_tangents

    lin = torch.nn.Linear(8, 8)
    f = torch.compile(lambda x: torch.relu(lin(x)), backend="aot_eager")
    x = torch.randn(4, 8)
    summed, mean = incoming_tangents([f(x).sum()]), incoming_tangents([f(x).mean()])
    assert summed == [([4, 8], "float32", False)] and mean == [([4, 8], "float32", True)]
    assert incoming_tangents([f(x)]) is None and lin.weight.grad is None  # (not a scalar: not known)

    tangent = types.SimpleNamespace(op="placeholder", name="tangents_1", bytes=128, shape=[4, 8], dtype="float32")
    plan = types.SimpleNamespace(backward=types.SimpleNamespace(nodes=[tangent]))
    monkeypatch.setattr(predict, "tangents_held", lambda version: True)
    assert predict._kept_tangents([plan], summed) == {0: []}
    assert predict._kept_tangents([plan], mean) == {0: ["tangents_1"]}
    assert predict._kept_tangents([plan], [([2, 8], "float32", True)]) == {}  # no pair's tangents match
    monkeypatch.setattr(predict, "tangents_held", lambda version: False)
    assert predict._kept_tangents([plan], mean) == {}  # (the version's rule: none held)


def test_a_prediction_counts_the_outputs_a_script_holds_beside_its_loss(tmp_path: Path) -> None:
    """`loss, logits = step(ids)` keeps the logits through the backward and into the next step, so a
    measured step rises from them. A prediction (stopped at the first backward) counts them in the
    bytes a step starts from, whether the plan saves them (budget 1: Inductor saves the logits'
    storage for the loss's backward) or not (budget 0 recomputes them), and its step is then the
    measured step to the byte; so is the estimate from a capture of each budget's run."""
    import runpy

    import torch
    import torch._functorch.config as functorch_config

    from memprof.sweep.predict import predict

    script = tmp_path / "holds.py"
    script.write_text(_HOLDS_LOGITS)
    torch._dynamo.reset()
    out = predict(str(script), ["hold"], [0.0, 1.0], None)
    assert [o.status for o in out] == ["completed", "completed"], [o.error for o in out]
    resident = [o.measured.resident if o.measured else None for o in out]
    assert resident[0] is not None and resident[0] == resident[1]  # the logits in both
    saved = sys.argv[:]
    for o in out:
        torch._dynamo.reset()
        sys.argv = [str(script), "hold", "4"]
        try:
            with functorch_config.patch(activation_memory_budget=o.budget), memprof.capture() as cap:
                runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.argv = saved
        m = measure(cap)
        assert o.measured is not None and m.step_peak is not None
        assert o.measured.estimates["memprof"] == m.estimates["memprof"] == m.step_peak, (o.budget, m.step_peak)
