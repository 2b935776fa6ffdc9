"""A compile-time prediction of a CUDA run's steps, replayed from the run's own capture and set beside
what the run measured: where a prediction and its verifying run disagree, this tells whether the
plans' walk, the caching allocator's model, the workspaces or the tangents are the cause, with
everything else equal.

    memprof trace --budget 0.0 --remat light -o run.memprof -- examples/train_bert.py --paper --steps 3
    python tools/replay_prediction.py run.memprof
    python tools/replay_prediction.py run.memprof --workspace 33MiB --lt 0 --tangents-held   # session 30's rules

The replay starts from the allocator as the capture shows it just before the first compiled-graph
call (where a prediction snapshots it) and the optimizer state the first step made
(`memprof.sweep.replay`), and runs the prediction's model of the first step and the steady one
(`estimate_capture_plans` with `FirstCalls`): each thread's cuBLAS workspace (`--workspace`), the
cuBLASLt one at a thread's first `addmm` (`--lt`), the tangents as the capture saw them (or every
one held, as torch 2.11's rule says, with `--tangents-held`). Not replayed: the first step's
autotuning flushes (which kernels autotune needs Triton and the run's Inductor cache). Prints the
comparison last.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import memprof
    from memprof.analysis.caching_allocator import OptimizerStep
    from memprof.analysis.units import parse_size
    from memprof.sweep.block_peak import FirstCalls
    from memprof.sweep.measure import measure
    from memprof.sweep.replay import prediction_inputs
    from memprof.sweep.step_estimate import estimate_capture_plans

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("capture")
    p.add_argument("--workspace", default="32MiB", help="each thread's cuBLAS workspace (default 32MiB: Hopper)")
    p.add_argument("--lt", default="1MiB", help="each thread's cuBLASLt workspace, made at its first addmm")
    p.add_argument("--tangents-held", action="store_true", help="every tangent held to the backward's end")
    p.add_argument("--torch", default="2.11.0", help="the torch version the run used")
    ns = p.parse_args(argv)
    cap = memprof.load(ns.capture)
    device = cap.main_device
    found = prediction_inputs(cap, device)
    if not device.startswith("cuda") or found is None:
        print(f"{ns.capture}: not a CUDA capture with a compiled-graph call and a step", file=sys.stderr)
        return 1
    before, state = found
    m = measure(cap, attribution=False)
    first = FirstCalls({}, 0, parse_size(ns.workspace), parse_size(ns.lt))
    est = estimate_capture_plans(cap.plans, cap.graphs, device, torch_version=ns.torch, allocator=before,
                                 between=OptimizerStep(state), first_calls=first,
                                 tangents=None if ns.tangents_held else cap.info.tangents_kept)
    if est is None or m.step_peak is None or m.resident is None or est.steady_start is None:
        print(f"{ns.capture}: the replay or the measurement found no step", file=sys.stderr)
        return 1
    rows = [("step peak above resident", m.step_peak, est.peak), ("resident", m.resident, est.steady_start),
            ("whole (allocated)", m.step_peak + m.resident, est.peak + est.steady_start)]
    print(f"| {ns.capture} | measured B | replayed prediction B | difference |")
    print("|---|---|---|---|")
    for what, measured, predicted in rows:
        diff = predicted - measured
        print(f"| {what} | {measured:,} | {predicted:,} | {diff:+,} ({diff / measured:+.3%}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
