"""Benchmark memprof's remat pass against stock budgets and per-layer checkpointing.

    python tools/bench_remat.py --model llama --paper --budgets 0.05:0.30:0.01 --jobs 13
    python tools/bench_remat.py --model bert --paper --budgets 0.01,0.05,0.10 --jobs 3
    python tools/bench_remat.py --model llama --layers 4 --seq 256 --budgets 0.05,0.3   # CPU, small
    python tools/bench_remat.py --model gpt2 --paper --budgets 0.05,0.10 --jobs 2      # the zoo: gpt2, gqa, vit

One worker process per budget compiles every variant of that budget side by side (stock, the
pass in each mode; `--ac` adds a worker for `torch.utils.checkpoint` around each layer), and
measures in that process:
- peak: max_memory_allocated during one fwd+bwd minus memory allocated before it (grads kept,
  median of 3; the paper's method; CPU: memprof's allocator capture), MB = 1e6 B;
- gradients against an eager fp32 reference (relative L2; Llama) or against the stock plan at
  budget 1.0 with the same seed (BERT: dropout masks differ between eager and compiled);
- step time, once every worker has compiled: workers time one at a time, each in rotating
  rounds over its variants (median and p10 over all timed steps); on CUDA also the kernels'
  busy time per step (the profiler's sum over 3 steps), which host-side launch gaps do not move;
- compile time (first step) and what the pass reported (its own seconds, edits, estimate).
The last output is the table; `--json` writes every row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from _examples import load_example  # noqa: E402  (tools/)

from memprof.sweep.runner import visible_gpus  # noqa: E402
from memprof.sweep.spec import parse_budgets  # noqa: E402

MODELS = ("llama", "bert", "gpt2", "gqa", "vit")


def example_loss(name: str, model: Any, ids: Any, ex: Any = None) -> Any:
    """The step's loss: the zoo's own (`loss_fn`: next-token or class cross entropy, under the
    example's precision, bf16 autocast by default); Llama's `last_hidden_state.sum()` (the
    paper's); for BERT a fixed random projection, since a plain sum is ~0 after LayerNorm."""
    import torch

    if ex is not None and hasattr(ex, "DTYPE"):  # (the zoo's scripts; Llama's loss_fn is the sum below, fp32)
        from _zoo import precision

        dtype = getattr(ex, "dtype_override", None) or ex.DTYPE
        with precision(str(ids[0].device if isinstance(ids, tuple) else ids.device), dtype):
            return ex.loss_fn(model, ids)
    out = model(input_ids=ids).last_hidden_state
    if name == "llama":
        return out.sum()
    g = torch.Generator().manual_seed(4242)
    r = torch.randn(out.shape[-1], generator=g).to(out.device)
    return (out * r).sum() / out[..., 0].numel()


# ----------------------------------------------------------------------------------- worker
def _inductor() -> Any:
    """A fresh Inductor backend object: Dynamo guards compiled code on the backend, so variants
    of the same model class compiled with different settings never reuse each other's code."""
    from torch._inductor.compile_fx import compile_fx

    def inductor(gm: Any, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs)

    return inductor


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.torch = torch
        self.args = args
        self.device = args.device
        ex = load_example(args.model)
        size = getattr(ex, "FULL", None) or ex.PAPER if args.paper else ex.SMALL
        over = {k: v for k, v in (("layers", args.layers), ("seq", args.seq), ("batch", args.batch)) if v}
        self.size = type(size)(**{**size.__dict__, **over})
        ex.dtype_override = args.dtype  # the zoo's precision: bf16 autocast (their default) or fp32
        self.ex = ex

    def build(self, ac: bool = False) -> Any:
        import functools

        from torch.utils.checkpoint import checkpoint

        model, ids = self.ex.build(self.size, self.device)
        self.ids = ids
        if ac:
            if hasattr(self.ex, "layers"):
                layers = self.ex.layers(model)
            else:
                layers = model.layers if hasattr(model, "layers") else model.encoder.layer
            for layer in layers:
                layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
        return model

    def loss(self, model: Any) -> Any:
        return example_loss(self.args.model, model, self.ids, self.ex)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def step(self, v: dict[str, Any]) -> None:
        if self.args.model == "bert":
            self.torch.manual_seed(1234)
        self.loss(v["fn"]).backward()

    def compile(self, name: str, budget: float, mode: str | None, ac: bool = False) -> dict[str, Any]:
        import torch._functorch.config as fc

        import memprof.remat as remat

        torch = self.torch
        model = self.build(ac)
        fn = torch.compile(model, backend=_inductor())  # its own backend: no cache entry is shared
        v: dict[str, Any] = {"name": name, "model": model, "fn": fn, "budget": budget, "mode": mode}
        old = fc.activation_memory_budget
        fc.activation_memory_budget = budget
        remat.reports(clear=True)
        t0 = time.perf_counter()
        try:
            if mode:
                with remat.enable(mode):
                    self.step(v)
            else:
                self.step(v)
            self.sync()
        finally:
            fc.activation_memory_budget = old
        v["compile_s"] = time.perf_counter() - t0
        reps = remat.reports(clear=True)
        v["pass_s"] = sum(r.seconds for r in reps)
        v["reports"] = [r.to_json() for r in reps]
        return v

    def peak(self, v: dict[str, Any]) -> float:
        torch = self.torch
        vals = []
        for _ in range(3):
            v["model"].zero_grad(set_to_none=False)
            self.sync()
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
                resident = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                self.step(v)
                self.sync()
                vals.append(torch.cuda.max_memory_allocated() - resident)
            else:
                import memprof

                with memprof.capture(scopes="none", kernels=False, plans=False) as cap:
                    self.step(v)
                vals.append(cap.peak("cpu"))
        return statistics.median(vals) / 1e6

    def gpu_ms(self, v: dict[str, Any], steps: int = 3) -> float | None:
        """The kernels' time per step (CUDA): what the plan asks of the GPU, whatever the host does
        meanwhile. A host-bound batch hides it behind launch gaps that swing between runs."""
        if not self.device.startswith("cuda"):
            return None
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        self.step(v)
        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                self.step(v)
            self.sync()
        busy = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
        return busy / steps / 1e3

    def grads(self, v: dict[str, Any]) -> Any:
        torch = self.torch
        v["model"].zero_grad(set_to_none=True)
        self.step(v)
        self.sync()
        return torch.cat([p.grad.detach().double().flatten().cpu() for p in v["model"].parameters()])

    def reference(self) -> Any:
        torch = self.torch
        model = self.build()
        model.zero_grad(set_to_none=True)
        self.step({"fn": model})
        return torch.cat([p.grad.detach().double().flatten().cpu() for p in model.parameters()])

    def time(self, variants: list[dict[str, Any]], rounds: int, steps: int) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {v["name"]: [] for v in variants}
        for r in range(rounds):
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:
                v["model"].zero_grad(set_to_none=False)
                self.step(v)
                self.sync()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    self.step(v)
                    self.sync()
                    times[v["name"]].append((time.perf_counter() - t0) * 1e3)
        return times


def worker_main(args: argparse.Namespace) -> None:
    import torch
    import torch._functorch.config as fc
    import torch._inductor.config as ic

    # every variant partitions and lowers from scratch; `--cold` also recompiles every kernel
    # (a first compile on a fresh machine), otherwise compiled kernels are shared between workers
    ic.force_disable_caches = args.cold
    ic.fx_graph_cache = False
    fc.enable_autograd_cache = False
    w = Worker(args)
    variants: list[dict[str, Any]] = []
    if args.ac:
        variants.append(w.compile("ac", 1.0, None, ac=True))
    else:
        variants.append(w.compile("stock", args.budget, None))
        for mode in args.modes.split(","):
            if mode:
                variants.append(w.compile(mode, args.budget, mode))
    rows: dict[str, dict[str, Any]] = {}
    ref = None
    if args.grads:  # BERT: the stock plan at budget 1.0 with the same masks; Llama: eager fp32
        ref = w.grads(w.compile("ref1.0", 1.0, None)) if args.model == "bert" else w.reference()
    for v in variants:
        row = {"variant": v["name"], "budget": v["budget"], "compile_s": v["compile_s"], "pass_s": v["pass_s"],
               "reports": v["reports"], "peak_mb": w.peak(v)}
        if ref is not None:
            g = w.grads(v)
            row["grad_rel_l2"] = float((g - ref).norm() / ref.norm())
        rows[v["name"]] = row
    print("PEAKS " + json.dumps(list(rows.values())), flush=True)
    if w.device.startswith("cuda"):  # hold only live tensors while the other workers compile
        torch.cuda.empty_cache()
    print("READY", flush=True)
    if sys.stdin.readline().strip() == "GO":
        times = w.time(variants, args.rounds, args.steps)
        for name, ts in times.items():
            ts.sort()
            rows[name]["step_ms"] = statistics.median(ts)
            rows[name]["step_p10_ms"] = ts[max(0, int(0.1 * len(ts)) - 1)] if ts else None
        for v in variants:
            rows[v["name"]]["gpu_ms"] = w.gpu_ms(v)
    print("RESULT " + json.dumps(list(rows.values())), flush=True)


# ----------------------------------------------------------------------------------- driver
def run_driver(args: argparse.Namespace) -> list[dict[str, Any]]:
    jobs: list[list[str]] = []
    common = ["--model", args.model, "--device", args.device, "--rounds", str(args.rounds), "--steps", str(args.steps),
              "--modes", args.modes]
    for k in ("layers", "seq", "batch", "dtype"):
        if getattr(args, k):
            common += [f"--{k}", str(getattr(args, k))]
    if args.paper:
        common.append("--paper")
    if args.grads:
        common.append("--grads")
    if args.cold:
        common.append("--cold")
    for b in parse_budgets(args.budgets):
        jobs.append([*common, "--budget", str(b)])
    if args.ac:
        jobs.append([*common, "--ac", "--budget", "1.0"])
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1")}
    procs: list[tuple[list[str], subprocess.Popen[str]]] = []
    pending = list(jobs)
    ready: list[tuple[list[str], subprocess.Popen[str]]] = []
    peaks: dict[int, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    started = 0
    gpus = visible_gpus()[: args.gpus]
    # phase 1: compile and measure peaks, `--jobs` workers at a time; each waits for GO
    while pending or procs:
        while pending and len(procs) < args.jobs:
            job = pending.pop(0)
            wenv = env
            if len(gpus) > 1:  # spread workers over the host's GPUs, round robin, as the sweep does
                wenv = {**env, "CUDA_VISIBLE_DEVICES": gpus[started % len(gpus)]}
            started += 1
            p = subprocess.Popen([sys.executable, __file__, "--worker", *job], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=wenv)
            procs.append((job, p))
        for job, p in list(procs):
            assert p.stdout is not None
            line = p.stdout.readline()
            while line and line.strip() != "READY":
                if line.startswith("PEAKS "):
                    peaks[id(p)] = json.loads(line[6:])
                line = p.stdout.readline()
            procs.remove((job, p))
            if line:
                ready.append((job, p))
                if args.json:  # peaks so far survive a driver that is killed
                    Path(args.json).write_text(json.dumps([r for v in peaks.values() for r in v], indent=1))
                print(f"[{time.perf_counter() - t0:6.0f} s] compiled {' '.join(job[-2:])}", file=sys.stderr,
                      flush=True)
            else:
                p.wait()
                print(f"worker {' '.join(job)} failed (exit {p.returncode})", file=sys.stderr, flush=True)
            break
    # phase 2: time one worker at a time, nothing else running (skipped past the deadline)
    rows: list[dict[str, Any]] = []
    if args.json:
        Path(args.json).write_text(json.dumps([r for v in peaks.values() for r in v], indent=1))
    for _job, p in ready:
        assert p.stdin is not None and p.stdout is not None
        if args.deadline and time.perf_counter() - t0 > args.deadline:
            print("deadline passed: step times not measured", file=sys.stderr, flush=True)
            rows.extend(peaks.get(id(p), []))
            p.stdin.write("STOP\n")
            p.stdin.flush()
            p.wait()
            continue
        p.stdin.write("GO\n")
        p.stdin.flush()
        for line in p.stdout:
            if line.startswith("RESULT "):
                rows.extend(json.loads(line[7:]))
        p.wait()
    print(f"[{time.perf_counter() - t0:6.0f} s] done", file=sys.stderr, flush=True)
    return rows


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    by_budget: dict[float, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_budget.setdefault(r["budget"] if r["variant"] != "ac" else -1.0, {})[r["variant"]] = r
    stock = {b: v["stock"]["peak_mb"] for b, v in by_budget.items() if "stock" in v}
    head = "| budget | stock MB | stock ms | stock GPU ms |"
    sep = "|---|---|---|---|"
    for m in modes:
        head += f" {m} MB (×stock) | {m} ms (×stock) | {m} GPU ms (×stock) | {m} ≤ stock at ≥budget |"
        sep += "---|---|---|---|"
    head += " grad rel L2 (stock / " + " / ".join(modes) + ") | compile s (stock / pass added) | random saved MB |"
    lines = [head, sep + "---|---|---|"]
    for b in sorted(k for k in by_budget if k >= 0):
        v = by_budget[b]
        s = v.get("stock")
        if s is None:
            continue
        line = f"| {b:.2f} | {s['peak_mb']:.1f} | {s.get('step_ms', float('nan')):.1f} | {_ms(s.get('gpu_ms'))} |"
        suffix_min = min(p for bb, p in stock.items() if bb >= b)
        grads = [f"{s.get('grad_rel_l2', float('nan')):.1e}"]
        for m in modes:
            r = v.get(m)
            if r is None:
                line += " – | – | – | – |"
                continue
            ok = "yes" if r["peak_mb"] <= suffix_min + 1e-9 else "NO"
            ms, stock_ms = r.get("step_ms", float("nan")), s.get("step_ms", float("nan"))
            gpu, stock_gpu = r.get("gpu_ms"), s.get("gpu_ms")
            gpu_ratio = f" ({gpu / stock_gpu:.3f})" if gpu is not None and stock_gpu else ""
            line += (f" {r['peak_mb']:.1f} ({r['peak_mb'] / s['peak_mb']:.2f}) | {ms:.1f} ({ms / stock_ms:.3f}) |"
                     f" {_ms(gpu)}{gpu_ratio} | {ok} |")
            grads.append(f"{r.get('grad_rel_l2', float('nan')):.1e}")
        pass_s = max((v[m]["pass_s"] for m in modes if m in v), default=0.0)
        masks = max((sum(rep.get("random_saved_bytes", 0) for rep in v[m]["reports"]) for m in modes if m in v),
                    default=0)
        line += f" {' / '.join(grads)} | {s['compile_s']:.0f} / +{pass_s:.1f} | {masks / 1e6:.1f} |"
        lines.append(line)
    if -1.0 in by_budget:
        a = by_budget[-1.0]["ac"]
        lines.append(f"| per-layer checkpointing (budget 1.0) | {a['peak_mb']:.1f} |"
                     f" {a.get('step_ms', float('nan')):.1f} | {_ms(a.get('gpu_ms'))} |" + " |" * (4 * len(modes))
                     + f" {a.get('grad_rel_l2', float('nan')):.1e} | {a['compile_s']:.0f} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--paper", action="store_true", help="the paper's 32-layer configuration")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--budgets", default="0.05,0.10,0.13,0.30")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="the zoo's precision (default: the example's own, bf16 autocast)")
    parser.add_argument("--modes", default="light,all", help="comma-separated remat modes to compare with stock")
    parser.add_argument("--ac", action="store_true", help="add per-layer activation checkpointing (compiled)")
    parser.add_argument("--grads", action="store_true", help="compare gradients with a reference")
    parser.add_argument("--jobs", type=int, default=1, help="workers compiling at once")
    parser.add_argument("--gpus", type=int, default=1, help="spread workers over this many GPUs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None, help="write all rows here")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which remaining workers skip step timing (peaks are kept)")
    parser.add_argument("--cold", action="store_true",
                        help="no kernel cache either (compile times as on a fresh machine; slower)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        worker_main(args)
        return
    rows = run_driver(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    modes = [m for m in args.modes.split(",") if m]
    print(table(rows, modes))


if __name__ == "__main__":
    main()
