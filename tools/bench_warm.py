"""Cold and warm compiles: `memprof trace` and plain `python` of the bundled example, each with an
empty Inductor cache (cold) and again with the cache the cold run left (warm), in rotating rounds;
and both on a script that only imports torch. Whole-process wall times; the warm capture's
attribution is checked against the cold one's at every step (category, node, layer, kernel).
Prints a table last.

    python tools/bench_warm.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import memprof  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "train_llama.py")
BY = ("category", "node", "layer", "kernel")


def timed(cmd: list[str], cache: Path, cwd: Path, threads: int) -> float:
    t0 = time.perf_counter()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - t0


def differing_rows(a: memprof.Capture, b: memprof.Capture, first: int = 1) -> int:
    """Attribution rows that differ between the captures, at each step from `first` on."""
    out = 0
    for s in a.steps()[first - 1:]:
        for by in BY:
            ra = {(r.key, r.bytes, r.count) for r in a.attribution(at=f"step:{s.step}", by=by)}
            rb = {(r.key, r.bytes, r.count) for r in b.attribution(at=f"step:{s.step}", by=by)}
            if ra != rb:
                print(f"step {s.step} by {by}: cold only {sorted(ra - rb)[:3]}, warm only {sorted(rb - ra)[:3]}")
            out += len(ra ^ rb)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of every run (0: torch's default); with more than one, what the CPU "
                        "attention backward allocates varies from run to run by the threads' schedule")
    args = p.parse_args()
    times: dict[str, list[float]] = {}
    differ: list[int] = []
    differ_later: list[int] = []  # from step 2 on: a cold compile on CUDA benchmarks kernels on the device in step 1
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "imp.py").write_text("import torch\n")
        memprof_cmd = [sys.executable, "-m", "memprof", "trace", "--force"]
        variants = {
            "python": lambda out: [sys.executable, EXAMPLE],
            "memprof trace": lambda out: [*memprof_cmd, "-o", out, EXAMPLE],
        }
        for r in range(args.rounds):
            names = list(variants)[r % 2:] + list(variants)[: r % 2]
            for name in names:
                cache = d / f"cache-{name.replace(' ', '_')}-{r}"
                for phase in ("cold", "warm"):
                    out = str(d / f"{phase}.memprof")
                    times.setdefault(f"{name} ({phase})", []).append(timed(variants[name](out), cache, d, args.threads))
                if name == "memprof trace":
                    cold, warm = memprof.load(d / "cold.memprof"), memprof.load(d / "warm.memprof")
                    differ.append(differing_rows(cold, warm))
                    differ_later.append(differing_rows(cold, warm, first=2))
            for name, cmd in (("python imp.py", [sys.executable, "imp.py"]),
                              ("memprof trace imp.py", [*memprof_cmd, "-o", str(d / "imp.memprof"), "imp.py"])):
                times.setdefault(name, []).append(timed(cmd, d / "cache-imp", d, args.threads))
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the example's default
    print(f"\nthe bundled example (train_llama.py, {device}, OMP_NUM_THREADS={args.threads or 'default'}), "
          f"{args.rounds} rounds; whole-process seconds")
    print(f"{'command':<26} {'median s':>9}  runs")
    for name, ts in times.items():
        print(f"{name:<26} {statistics.median(ts):>9.2f}  {' '.join(f'{t:.2f}' for t in ts)}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"cold/warm: memprof trace {med['memprof trace (cold)'] / med['memprof trace (warm)']:.2f}x, "
          f"python {med['python (cold)'] / med['python (warm)']:.2f}x; warm attribution vs cold: "
          f"{sum(differ)} rows differ over {len(differ)} pairs ({sum(differ_later)} from step 2 on)")


if __name__ == "__main__":
    main()
