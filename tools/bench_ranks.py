"""Capture overhead per rank: a DDP training script (gloo, CPU) under torchrun with 2 ranks and with 1,
each plain and under `memprof trace`, in rotating rounds. The script times its own steps (median
of the steps after the warm-up, per rank); the overhead of a world size is memprof's median step
time over plain's for the same rank, per round (averaged over the ranks, and the worst rank), and
the table gives the medians over rounds. Prints a table last.

    python tools/bench_ranks.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = """\
import json, statistics, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
width, steps, warmup = {width}, {steps}, 5
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)]))
opt = torch.optim.AdamW(model.parameters())
x = torch.randn({batch}, width)
times = []
for step in range(steps):
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
json.dump(statistics.median(times[warmup:]), open(sys.argv[1] + f".{{dist.get_rank()}}", "w"))
dist.destroy_process_group()
"""


def run(script: Path, nproc: int, traced: bool, work: Path) -> list[float]:
    out = work / f"t{nproc}{int(traced)}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += ["-m", "memprof", "trace", str(script), str(out), "-o", str(work / "run.memprof"), "--force"] if traced \
        else [str(script), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {res.stderr.strip()[-600:]}")
    return [float(json.loads(Path(f"{out}.{r}").read_text())) for r in range(nproc)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    ratios: dict[int, list[float]] = {1: [], 2: []}  # worst rank
    means: dict[int, list[float]] = {1: [], 2: []}  # mean over ranks
    plain: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        script = work / "ddp.py"
        script.write_text(SCRIPT.format(width=a.width, steps=a.steps, batch=a.batch))
        variants = [(1, False), (1, True), (2, False), (2, True)]
        for k in range(a.rounds):
            order = variants[k % len(variants):] + variants[:k % len(variants)]
            got = {v: run(script, v[0], v[1], work) for v in order}
            for n in (1, 2):
                base, traced = got[(n, False)], got[(n, True)]
                # per rank: memprof's step time over plain's for the same rank, then the worst rank
                per_rank = [t / b for t, b in zip(traced, base, strict=True)]
                ratios[n].append(max(per_rank))
                means[n].append(statistics.mean(per_rank))
                plain[n].append(statistics.median(base))
            print(f"round {k + 1}: " + ", ".join(f"{n} rank(s) {ratios[n][-1]:.3f}" for n in (1, 2)), flush=True)
    print()
    print("| world size | plain step ms | memprof / plain, mean over ranks | worst rank (each round) | rounds |")
    print("|---|---|---|---|---|")
    for n in (1, 2):
        print(f"| {n} | {statistics.median(plain[n]) * 1e3:.2f} | {statistics.median(means[n]):.3f} | "
              f"{statistics.median(ratios[n]):.3f} ({', '.join(f'{r:.3f}' for r in ratios[n])}) | {a.rounds} |")
    print("(medians over rounds; a round runs each variant once, in rotating order)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
