"""What capturing costs per CPU allocation: a loop of `torch.empty(4)` allocations and frees, plain
and under `memprof.capture()` (scopes none and ops), in rotating rounds in one process. Prints a
table last: median nanoseconds per allocation-and-free, and the ratio to plain.

    python tools/bench_cpu_capture.py --n 200000 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import memprof


def loop(n: int) -> None:
    for _ in range(n):
        t = torch.empty(4)
        del t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    variants = ["plain", "none", "ops"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    loop(1000)
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:
            t0 = time.perf_counter()
            if v == "plain":
                loop(args.n)
            else:
                with memprof.capture(scopes=v):
                    loop(args.n)
            times[v].append((time.perf_counter() - t0) * 1e9 / args.n)
    plain = statistics.median(times["plain"])
    print(f"memprof {memprof.__file__}")
    print(f"{'variant':<14} {'ns per alloc+free':>18} {'ratio':>6}")
    for v in variants:
        med = statistics.median(times[v])
        print(f"{'plain' if v == 'plain' else 'scopes=' + v:<14} {med:>18.0f} {med / plain:>6.2f}")


if __name__ == "__main__":
    main()
