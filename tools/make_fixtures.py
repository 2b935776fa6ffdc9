"""Write the small captures committed under tests/fixtures/ (run from the repository root).

    python tools/make_fixtures.py            # on the CPU: tiny_compiled.memprof
    python tools/make_fixtures.py --cuda     # on a GPU machine: tiny_compiled_cuda.memprof
    python tools/make_fixtures.py --zoo      # on the CPU: gpt2_bf16_cpu.memprof
    python tools/make_fixtures.py --blocks   # on a GPU machine: gqa_blocks_cuda.memprof
    python tools/make_fixtures.py --autotune # with Triton: gqa_blocks_cuda.autotune.json
    python tools/make_fixtures.py --snapshot # on a GPU machine: tiny_snapshot_cuda.pickle (+ .json)
    python tools/make_fixtures.py --remat    # on the CPU: llama_remat_cpu.memprof
    python tools/make_fixtures.py --ddp      # on the CPU: ddp_rank_cpu.memprof

A two-layer MLP compiled with Inductor, three AdamW steps, so that each file has every member
(events, strings, threads, plans, wrapper sources; on CUDA also the allocator tracker's reserved
bytes). Tests read them instead of compiling a model (tests/unit/test_fixtures.py); the fuzz test
of the loader mutates the CPU one. The CUDA one records, in its metadata, what PyTorch itself
reported (`expected`: max_memory_allocated and, at each step's end, memory_allocated and
memory_reserved), so CPU-only CI checks the capture against PyTorch's own counters.

`--zoo` traces the zoo's small GPT-2 (`examples/train_gpt2.py`: bf16 autocast, fused AdamW, model
and loss compiled as two graphs) with `memprof trace`, as a user would, for the tests of the
sweep's step peak and memprof's estimate (tests/unit/test_zoo_estimate.py).

`--blocks` traces the zoo's GQA decoder at full width with 2 layers and batch 1 (bf16, budget 0.05,
compiled-graph scopes only, to keep the file small) on the GPU, from the process's start: the
caching allocator hands whole blocks to some requests there, so the tests of its model
(tests/unit/test_caching_allocator.py) replay every block and the estimate's count of them.

`--autotune` says which Triton kernels of gqa_blocks_cuda.memprof's graphs benchmark their configs
at their first launch (`memprof.torch_hooks.inductor.autotuned_kernels`, with an empty Inductor
cache, as that run had): Triton is needed to read their heuristics, which CPU-only CI lacks.

`--remat` traces the bundled Llama (`examples/train_llama.py`) with `--remat light --budget 0.05`
(compiled-graph scopes only, to keep the file small), for the tests of what the HTML report shows of
a plan and the remat pass's report (tests/integration/test_html.py).

`--ddp` runs the DDP script of tests/integration/test_ranks.py under torchrun (2 ranks, gloo) until
one rank's capture shows what made DDP's bucket labels flaky: the bucket the second forward rebuilds
is freed by a gloo thread, not the thread that made it (3 of 16 rank captures here did), and keeps
that rank's capture, for a test that does not depend on the run's timing (tests/unit/test_fixtures.py).

`--snapshot` is not memprof's: it is what a user brings, `torch.cuda.memory._dump_snapshot` of the
same MLP's three steps with the allocator's history on from before the model was made (Python
stacks only, to keep the file small), and beside it what PyTorch reported (`max_memory_allocated`,
`memory_allocated` at the end) for the tests of reading a real snapshot (tests/integration/test_snapshot.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import memprof
from memprof.analysis.attribution import Category

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def tiny_compiled(device: str) -> memprof.Capture:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ends: list[list[int]] = []
    with memprof.capture(meta={"command": f"tools/make_fixtures.py tiny_compiled ({device})"}) as cap:
        compiled = torch.compile(model)
        for _ in range(3):
            compiled(torch.randn(16, 32, device=device)).sum().backward()
            opt.step()  # the step marker: what PyTorch reports here is the step's end
            if cuda:
                ends.append([int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved())])
            opt.zero_grad()
        if cuda:
            cap.meta["expected"] = {"max_memory_allocated": int(torch.cuda.max_memory_allocated()),
                                    "step_ends": ends}
    return cap


def bucket_freed_elsewhere(cap: memprof.Capture) -> bool:
    """Whether a block labelled as DDP's bucket is freed on a thread other than the one that made it."""
    tl, labels, raw = cap.timeline("cpu"), cap.labels("cpu"), cap.raw
    buckets = np.flatnonzero(tl.is_alloc & (labels.category == Category.DDP_BUCKET) & (tl.free_of >= 0))
    return bool(np.any(raw["thread"][tl.rows[tl.free_of[buckets]]] != raw["thread"][tl.rows[buckets]]))


def ddp_rank(out: Path, tries: int = 12) -> None:
    sys.path.insert(0, str(OUT.parents[1]))
    from tests.integration.test_ranks import DDP

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ddp.py").write_text(DDP)
        for _ in range(tries):
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "memprof", "trace", "ddp.py", "-o", "run.memprof", "--force"], cwd=tmp, check=True)
            for rank in (0, 1):
                path = Path(tmp) / f"run.rank{rank}.memprof"
                if bucket_freed_elsewhere(memprof.load(path)):
                    shutil.copy(path, out)
                    return
    raise SystemExit(f"no rank's bucket was freed by another thread in {tries} runs")


def real_snapshot(out: Path) -> None:
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model)
    for _ in range(3):
        compiled(torch.randn(16, 32, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(str(out))
    torch.cuda.memory._record_memory_history(enabled=None)
    expected = {"max_memory_allocated": int(torch.cuda.max_memory_allocated()),
                "memory_allocated": int(torch.cuda.memory_allocated()),
                "memory_reserved": int(torch.cuda.memory_reserved()),
                "torch": torch.__version__}
    out.with_suffix(".json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true", help="the CUDA fixture (needs a GPU)")
    p.add_argument("--zoo", action="store_true", help="the bf16 GPT-2 fixture (CPU)")
    p.add_argument("--blocks", action="store_true", help="the GQA decoder's caching-allocator fixture (needs a GPU)")
    p.add_argument("--autotune", action="store_true", help="the GQA fixture's autotuning kernels (needs Triton)")
    p.add_argument("--snapshot", action="store_true", help="a real _dump_snapshot of the MLP (needs a GPU)")
    p.add_argument("--remat", action="store_true", help="the bundled Llama under --remat light (CPU)")
    p.add_argument("--ddp", action="store_true", help="a DDP rank whose bucket a gloo thread frees (CPU, torchrun)")
    ns = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if ns.ddp:
        out = OUT / "ddp_rank_cpu.memprof"
        ddp_rank(out)
        print(f"wrote {out} ({out.stat().st_size:,} bytes)")
        raise SystemExit(0)
    if ns.snapshot:
        out = OUT / "tiny_snapshot_cuda.pickle"
        real_snapshot(out)
        print(f"wrote {out} ({out.stat().st_size:,} bytes)")
        raise SystemExit(0)
    if ns.blocks:
        out = OUT / "gqa_blocks_cuda.memprof"
        script = OUT.parents[1] / "examples" / "train_gqa.py"
        subprocess.run([sys.executable, "-m", "memprof", "trace", "-o", str(out), "--force", "--scopes", "graphs",
                        "--budget", "0.05", "--", str(script), "--full", "--layers", "2", "--batch", "1",
                        "--steps", "4"], check=True)
        print(f"wrote {out} ({out.stat().st_size:,} bytes)")
        raise SystemExit(0)
    if ns.autotune:
        out = OUT / "gqa_blocks_cuda.autotune.json"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # (no kernel's best config cached)
        from memprof.torch_hooks.inductor import autotuned_kernels

        tuned: dict[str, list[str]] = {}
        for g in memprof.load(OUT / "gqa_blocks_cuda.memprof").graphs:
            found = autotuned_kernels(str(g.source))
            if found is None or found[1]:
                raise SystemExit(f"the {g.role} graph's kernels could not all be told: {found}")
            tuned[f"{g.plan}:{g.role}"] = sorted(found[0])
        out.write_text(json.dumps({"torch": torch.__version__, "autotuned": tuned}, indent=1) + "\n")
        print(f"wrote {out} ({out.stat().st_size:,} bytes)")
        raise SystemExit(0)
    if ns.remat:
        out = OUT / "llama_remat_cpu.memprof"
        script = OUT.parents[1] / "examples" / "train_llama.py"
        subprocess.run([sys.executable, "-m", "memprof", "trace", "-o", str(out), "--force", "--scopes", "graphs",
                        "--remat", "light", "--budget", "0.05", "--", str(script), "--steps", "3"], check=True)
        print(f"wrote {out} ({out.stat().st_size:,} bytes)")
        raise SystemExit(0)
    if ns.zoo:
        out = OUT / "gpt2_bf16_cpu.memprof"
        script = OUT.parents[1] / "examples" / "train_gpt2.py"
        subprocess.run([sys.executable, "-m", "memprof", "trace", "-o", str(out), "--force", "--", str(script),
                        "--steps", "5", "--device", "cpu"], check=True)
        print(f"wrote {out} ({out.stat().st_size:,} bytes)")
        raise SystemExit(0)
    name = "tiny_compiled_cuda.memprof" if ns.cuda else "tiny_compiled.memprof"
    path = tiny_compiled("cuda:0" if ns.cuda else "cpu").save(OUT / name)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
