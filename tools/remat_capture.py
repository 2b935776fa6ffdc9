"""Capture one compiled training step of an example model with memprof: stock, with the remat pass,
or with per-layer activation checkpointing — to compare them with `memprof diff`.

    python tools/remat_capture.py --model llama --paper --budget 0.10 --remat light -o llama_010
    python tools/remat_capture.py --model gqa --paper --budget 0.02 --remat light -o gqa_light
    python tools/remat_capture.py --model gqa --paper --ac -o gqa_ac           # checkpoint per layer
    memprof diff gqa_ac.memprof gqa_light.memprof --at step:2 --by node        # what light holds more
    memprof report llama_010.memprof --by node --at step:2      # what is live at the step's peak

Builds the model as tools/bench_remat.py's workers do (the same sizes, `--layers/--seq/--batch`
overrides, loss and precision), compiles inside a capture (step 1), then measures step 2 the way
the benchmark does: `max_memory_allocated` during one forward+backward minus memory allocated
before it, grads kept (CPU: the capture's exact step-2 peak above what was live before it).
Writes PREFIX.memprof (step markers after each step, compile plans with the pass's report) and
PREFIX.json (peak, the pass's reports), and prints one line.
This is how the 67 MB dense attention-mask copy behind the pass's budget-0.10 gap on the paper
Llama was found (docs/remat.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_remat import MODELS, Worker  # (the benchmark's model, loss and checkpointing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--paper", action="store_true", help="the full-size configuration")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="the zoo's precision")
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--remat", choices=["off", "light", "all"], default="light")
    parser.add_argument("--ac", action="store_true", help="per-layer checkpointing, stock plan (no remat)")
    parser.add_argument("-o", "--output", required=True, help="prefix of the .memprof and .json written")
    args = parser.parse_args()
    if not 0.0 <= args.budget <= 1.0:
        parser.error(f"--budget must be in [0, 1], got {args.budget}")

    import torch

    import memprof
    import memprof.remat as remat

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    worker = Worker(args)
    mode = None if args.ac or args.remat == "off" else args.remat
    cuda = torch.cuda if args.device == "cuda" else None
    with memprof.capture(meta={"budget": args.budget, "remat": mode or "off", "ac": args.ac}) as cap:
        variant = worker.compile("capture", args.budget, mode, ac=args.ac)  # step 1: compiles
        memprof.step()
        variant["model"].zero_grad(set_to_none=False)
        if cuda:
            cuda.synchronize()
            cuda.empty_cache()
            before = cuda.memory_allocated()
            cuda.reset_peak_memory_stats()
        worker.step(variant)
        worker.sync()
        memprof.step()
    if cuda:
        peak = cuda.max_memory_allocated() - before
    else:  # the capture's exact step-2 peak above what step 1 left live
        steps = {s.step: s for s in cap.steps("cpu")}
        peak = steps[2].peak - steps[1].allocated_at_end
    cap.save(f"{args.output}.memprof")
    reports = variant["reports"]
    Path(f"{args.output}.json").write_text(json.dumps({"peak_mb": peak / 1e6, "budget": args.budget,
                                                       "remat": mode, "ac": args.ac, "reports": reports}, indent=1))
    lines = "; ".join(remat.RematReport.from_json(r).summary() for r in reports) or "no remat report"
    what = "per-layer checkpointing" if args.ac else f"budget {args.budget:g} remat {mode or 'off'}"
    print(f"{args.model} {what}: step peak {peak / 1e6:.1f} MB ({lines})")


if __name__ == "__main__":
    main()
