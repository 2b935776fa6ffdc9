"""Attribution of saved captures: category shares at the peak, join coverage, and its cost.

    python tools/bench_attribution.py llama_0.05.memprof bert_0.05.memprof ... [--repeat 3]

For each capture: the live bytes at the main device's peak by category, the unattributed
share, how many compiled-graph calls were joined at buffer level, the recomputed share of
the step's activation bytes (saved + recomputed + rng_mask + temporary + workspace, the
quantity the paper's "94% recomputed" refers to), and the wall time of `memprof.load` and of
the attribution (timeline + labels + rows), median of --repeat fresh runs. Prints a table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memprof
from memprof.analysis.units import fmt_bytes

ACTIVATION = ("saved_activation", "recomputed", "rng_mask", "temporary", "workspace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("captures", nargs="+")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    table = []
    for path in args.captures:
        load_s, attr_s = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            cap = memprof.load(path)
            t1 = time.perf_counter()
            cap.attribution(at="peak", by="category")
            t2 = time.perf_counter()
            load_s.append(t1 - t0)
            attr_s.append(t2 - t1)
        dev = cap.main_device
        complete = [s.step for s in cap.steps(dev) if s.complete]
        for at in ["peak"] + ([f"step:{complete[-1]}"] if complete else []):
            table.append(report(cap, path, dev, at, statistics.median(load_s), statistics.median(attr_s)))
    print("\n| capture | at | events | live MB | param | grad | opt state | input | saved | recomp | rng mask | temp "
          "| workspace | unattr | recomputed / activations | calls joined | load s | attribution s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, at, events, peak, shares, act, joined, ncalls, ls, ats in table:
        cols = [shares.get(k, 0) / peak for k in ("parameter", "gradient", "optimizer_state", "input",
                                                   "saved_activation", "recomputed", "rng_mask", "temporary",
                                                   "workspace", "unattributed")]
        rec = shares.get("recomputed", 0) / act if act else 0.0
        print(f"| {name} | {at} | {events:,} | {peak / 1e6:.1f} | " + " | ".join(f"{c:.1%}" for c in cols)
              + f" | {rec:.1%} | {joined}/{ncalls} | {ls:.2f} | {ats:.2f} |")


def report(cap: memprof.Capture, path: str, dev: str, at: str, load_s: float, attr_s: float) -> tuple:  # type: ignore[type-arg]
    rows = cap.attribution(at=at, by="category")
    peak = sum(r.bytes for r in rows)
    shares = {r.key: r.bytes for r in rows}
    act = sum(shares.get(k, 0) for k in ACTIVATION)
    calls = cap.labels(dev).calls
    joined = sum(c.level == "buffer" for c in calls)
    plan = cap.plans[0] if cap.plans else None
    print(f"\n{path} at {at}: {len(cap.raw):,} events, {dev} {peak:,} B live ({fmt_bytes(peak)}), "
          f"budget {cap.meta.get('budget')}")
    for r in rows:
        print(f"  {r.key:<18} {r.bytes:>14,} B  {r.share:6.1%}")
    if plan is not None:
        print(f"  plan 0: {len(plan.saved)} saved, {len(plan.recomputed)} recomputed, "
              f"{len(plan.recomputed_random)} random recomputed, {len(plan.masks)} masks")
    for by in ("node", "layer"):
        top = cap.attribution(at=at, by=by)[:5]
        print(f"  top by {by}: " + "; ".join(f"{r.key} {fmt_bytes(r.bytes)} ({r.category})" for r in top))
    return (Path(path).stem, at, len(cap.raw), peak, shares, act, joined, len(calls), load_s, attr_s)


if __name__ == "__main__":
    main()
