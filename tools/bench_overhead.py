"""Capture overhead on the paper Llama (budget 0.13, compiled), side by side in one process.

Variants run in rotating rounds (blocks of --block steps each, the order rotating every
round) so drift hits them alike; each step is timed wall-clock with a CUDA sync at its end, and
by the process's CPU time up to that sync (the host's work for the step, all threads: equal to
the wall clock where the step is host-bound, and no steadier). Prints a table last: median and p10 step time,
ratio to plain, the median CPU time per step and its ratio to plain's, the paired ratio to memprof's
in-RAM capture (each round's block median over memprof's in the same round, the median over
rounds), capture bytes per event, and `memprof report` time on a capture of that run. With
`--coverage`, then: each of the paper Llama and BERT compiled inside a default capture (and one
with `--kernel-scopes`), and how many of their compiled-graph calls were joined buffer by buffer.

    python tools/bench_overhead.py --batch 2 --batch 16 --rounds 6 --block 10
    python tools/bench_overhead.py --batch 2 --rounds 16 --block 10 \
        --variants "memprof + spill (trace),memprof + ring (--keep-last 2)"

`--device cpu` runs the same step on the CPU, on a Llama of the paper's depth and tiny widths (one
intra-op thread): a host-bound step (the Python, the dispatcher, the optimizer's loop over its
parameters, memprof's hooks) without a GPU. The variants of CUDA's own tools and `--coverage` need
CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import memprof  # noqa: E402
import memprof.reporters  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
from _examples import load_example  # noqa: E402

LAST_CAPTURE: list[memprof.Capture] = []
LAST_QUIET: list[memprof.Capture] = []


@contextlib.contextmanager
def plain() -> Iterator[None]:
    yield


@contextlib.contextmanager
def memprof_default() -> Iterator[None]:
    with memprof.capture() as cap:
        yield
    LAST_CAPTURE[:] = [cap]


@contextlib.contextmanager
def memprof_spill() -> Iterator[None]:
    """The default capture streaming to its spill (what `memprof trace` does), saved at the end."""
    with tempfile.TemporaryDirectory() as d, memprof.capture(output=Path(d) / "bench.memprof"):
        yield


@contextlib.contextmanager
def memprof_ring() -> Iterator[None]:
    """`memprof trace --keep-last 2`: the ring moves at every step, its spill is rewritten as it grows."""
    with tempfile.TemporaryDirectory() as d, memprof.capture(output=Path(d) / "bench.memprof", keep_last=2):
        yield


@contextlib.contextmanager
def memprof_kernel_scopes() -> Iterator[None]:
    """Inductor's scope per kernel launch as well (the profiler flag): the default before 2026-12-04."""
    with memprof.capture(kernels=True):
        yield


@contextlib.contextmanager
def memprof_loud_graphs() -> Iterator[None]:
    """The default before compiled-graph calls ran quiet (2026-12-04, session 15): every op scope
    inside them recorded."""
    from memprof.torch_hooks import runtime

    ready = runtime._QuietGraphs.ready
    runtime._QuietGraphs.ready = lambda self, key, graph: False  # type: ignore[method-assign]
    try:
        with memprof.capture():
            yield
    finally:
        runtime._QuietGraphs.ready = ready  # type: ignore[method-assign]


@contextlib.contextmanager
def memprof_quiet_optimizer() -> Iterator[None]:
    """The default with the optimizer's steps quiet too (an experiment: no op scope inside them)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from memprof._native import native

    C = native()

    def quiet(on: bool) -> Callable[..., None]:
        def hook(*args: object) -> None:  # (returns None: a pre-hook's result would replace the args)
            C.set_quiet(on)

        return hook

    pre = register_optimizer_step_pre_hook(quiet(True))  # type: ignore[no-untyped-call]
    post = register_optimizer_step_post_hook(quiet(False))  # type: ignore[no-untyped-call]
    try:
        with memprof.capture() as cap:
            yield
        LAST_QUIET[:] = [cap]
    finally:
        pre.remove()
        post.remove()


@contextlib.contextmanager
def memprof_graphs() -> Iterator[None]:
    with memprof.capture(scopes="graphs"):
        yield


@contextlib.contextmanager
def memprof_allocs() -> Iterator[None]:
    with memprof.capture(scopes="none"):
        yield


@contextlib.contextmanager
def memory_history() -> Iterator[None]:
    torch.cuda.memory._record_memory_history(stacks="python")
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def torch_profiler() -> Iterator[None]:
    with torch.profiler.profile(profile_memory=True):
        yield


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "plain": plain,
    "memprof": memprof_default,
    "memprof + spill (trace)": memprof_spill,
    "memprof + ring (--keep-last 2)": memprof_ring,
    "memprof --kernel-scopes": memprof_kernel_scopes,
    "memprof (loud graph calls)": memprof_loud_graphs,
    "memprof + quiet optimizer": memprof_quiet_optimizer,
    "memprof --scopes graphs": memprof_graphs,
    "memprof --scopes none": memprof_allocs,
    "_record_memory_history(python)": memory_history,
    "torch.profiler(profile_memory)": torch_profiler,
}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


CPU_WIDTHS = {"hidden": 32, "heads": 2, "mlp": 64, "vocab": 128, "seq": 8}  # (--device cpu: the paper's depth)
CUDA_ONLY = ("_record_memory_history(python)",)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(batch: int, rounds: int, block: int, names: list[str], device: str = "cuda") -> list[dict[str, object]]:
    ex = load_example("llama")
    import torch._functorch.config as fc

    torch._dynamo.reset()
    fc.activation_memory_budget = 0.13
    size = ex.LlamaSize(**{**ex.PAPER.__dict__, **(CPU_WIDTHS if device == "cpu" else {}), "batch": batch})
    model, ids = ex.build(size, device)
    fn = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    cpu: dict[str, list[float]] = {k: [] for k in names}  # the host's CPU time per step (all threads)

    def step() -> tuple[float, float]:
        """The step's wall-clock time and its CPU time up to the sync."""
        t, c = time.perf_counter(), time.process_time()
        fn(input_ids=ids).last_hidden_state.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # (before the sync, which spins: the CPU time the step's launches took; near the wall clock,
        # the step is host-bound)
        cpu_s = time.process_time() - c
        sync(device)
        return time.perf_counter() - t, cpu_s

    t = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t
    for name in names:  # warm every variant once
        with VARIANTS[name]():
            for _ in range(3):
                step()
    times: dict[str, list[float]] = {k: [] for k in names}
    blocks: dict[str, list[float]] = {k: [] for k in names}  # each round's block median
    events = 0
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            with VARIANTS[name]():
                wall_cpu = [step() for _ in range(block)]
                block_times = [w for w, _c in wall_cpu]
                cpu[name] += [c for _w, c in wall_cpu]
            times[name] += block_times
            blocks[name].append(statistics.median(block_times))
            if name == "memprof":
                events += len(LAST_CAPTURE[0].raw)
    cap = LAST_CAPTURE[0]
    base = statistics.median(times["plain"])
    rows: list[dict[str, object]] = []
    for name in names:
        med = statistics.median(times[name])
        # paired: this variant's block against memprof's in the same round, the median over rounds
        paired = statistics.median(b / m for b, m in zip(blocks[name], blocks["memprof"], strict=True))
        rows.append({"batch": batch, "variant": name, "steps": len(times[name]), "median_ms": med * 1e3,
                     "p10_ms": pct(times[name], 0.1) * 1e3, "p90_ms": pct(times[name], 0.9) * 1e3,
                     "ratio": med / base, "vs_memprof": paired, "compile_s": compile_s,
                     "cpu_ms": statistics.median(cpu[name]) * 1e3,
                     "cpu_ratio": statistics.median(cpu[name]) / statistics.median(cpu["plain"])})
    # capture memory per event, and report time on the last memprof capture (one block)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.memprof"
        cap.save(path)
        t = time.perf_counter()
        loaded = memprof.load(path)
        memprof.reporters.render("text", loaded)
        in_process = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memprof", "report", str(path)], check=True, capture_output=True)
        cli = time.perf_counter() - t
    strings_bytes = sum(len(s) + 1 for s in cap.strings)
    for row in rows:
        if row["variant"] == "memprof + quiet optimizer" and LAST_QUIET:
            row.update(events_per_step=len(LAST_QUIET[0].raw) / block)
        if row["variant"] == "memprof":
            row.update(events_per_step=len(cap.raw) / block,
                       bytes_per_event=(cap.raw.nbytes + strings_bytes) / len(cap.raw),
                       report_s_in_process=in_process, report_s_cli=cli, capture_events=len(cap.raw))
    return rows


def coverage(model: str, batch: int, kernels: bool) -> dict[str, object]:
    """The paper `model` compiled and run 3 steps inside a capture: its compiled-graph calls, and how
    many were joined buffer by buffer (the rest at kernel level, with their reasons)."""
    import torch._functorch.config as fc

    ex = load_example(model)
    torch._dynamo.reset()
    with fc.patch(activation_memory_budget=0.13), memprof.capture(kernels=kernels) as cap:
        model_, ids = ex.build(type(ex.PAPER)(**{**ex.PAPER.__dict__, "batch": batch}), "cuda")
        fn = torch.compile(model_)
        opt = torch.optim.AdamW(model_.parameters(), lr=1e-4)
        for _ in range(3):
            fn(input_ids=ids).last_hidden_state.sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    calls = cap.labels("cuda:0").calls
    reasons = sorted({c.reason for c in calls if c.level != "buffer"})
    return {"model": model, "kernels": kernels, "calls": len(calls),
            "buffer": sum(c.level == "buffer" for c in calls), "reasons": reasons}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--coverage", action="store_true",
                    help="then check join coverage on the paper Llama and BERT (default and --kernel-scopes)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated variants to run (plain and memprof always run)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.device == "cpu":
        if args.coverage:
            ap.error("--coverage needs CUDA (the paper models at their size)")
        names = [v for v in names if v not in CUDA_ONLY]  # (the default list names them)
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu measures the host-bound step on the CPU")
    names = ["plain", "memprof", *[v for v in names if v not in ("plain", "memprof")]]
    rows: list[dict[str, object]] = []
    timed = (args.batch or [2]) if args.rounds > 0 else []  # (--rounds 0 --coverage: the coverage alone)
    for b in timed:
        rows += bench(b, args.rounds, args.block, names, args.device)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        print_table(rows, args.device)
    if args.coverage:
        batch = (args.batch or [2])[0]
        joined = [coverage(m, batch, k) for m in ("llama", "bert") for k in (False, True)]
        if args.json:
            args.json.write_text(json.dumps({"steps": rows, "coverage": joined}, indent=1))
        print_table(rows, args.device)
        print("\njoin coverage (compiled inside the capture, 3 steps, budget 0.13)")
        for c in joined:
            scopes = "--kernel-scopes" if c["kernels"] else "default"
            print(f"  {c['model']:<6} {scopes:<16} {c['buffer']}/{c['calls']} calls joined buffer by buffer"
                  + (f"; others: {'; '.join(c['reasons'])}" if c["reasons"] else ""), flush=True)


def print_table(rows: list[dict[str, object]], device: str = "cuda") -> None:
    where = torch.cuda.get_device_name() if device == "cuda" else (
        f"CPU, one intra-op thread, widths {CPU_WIDTHS}")
    print(f"\npaper Llama, budget 0.13, Inductor, {where}, torch {torch.__version__}")
    print(f"{'batch':>5} {'variant':<32} {'steps':>5} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} "
          f"{'ratio':>6} {'vs memprof':>10} {'CPU ms':>7} {'CPU ratio':>9}  extra")
    for r in rows:
        extra = f"{r['events_per_step']:.0f} ev/step" if "events_per_step" in r else ""
        if "bytes_per_event" in r:
            extra = (f"{r['events_per_step']:.0f} ev/step, {r['bytes_per_event']:.1f} B/event, report "
                     f"{r['report_s_in_process']:.2f} s in-process / {r['report_s_cli']:.2f} s CLI "
                     f"({r['capture_events']} events)")
        print(f"{r['batch']:>5} {r['variant']:<32} {r['steps']:>5} {r['median_ms']:>10.2f} {r['p10_ms']:>8.2f} "
              f"{r['p90_ms']:>8.2f} {r['ratio']:>6.3f} {r['vs_memprof']:>10.3f} {r['cpu_ms']:>7.2f} "
              f"{r['cpu_ratio']:>9.3f}  {extra}", flush=True)

if __name__ == "__main__":
    main()
