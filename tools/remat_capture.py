"""Capture one compiled training step of an example model with memprof, stock or with the remat pass.

    python tools/remat_capture.py --model llama --paper --budget 0.10 --remat light -o llama_010
    memprof report llama_010.memprof --by node --at step:2      # what is live at the step's peak

Compiles inside a capture (step 1), then measures step 2 the way tools/bench_remat.py does:
`max_memory_allocated` during one forward+backward minus memory allocated before it, grads kept
(CPU: the capture's exact step-2 peak above what was live before it). Writes PREFIX.memprof
(step markers after each step, compile plans with the pass's report) and PREFIX.json (peak, the
pass's reports), and prints one line.
This is how the 67 MB dense attention-mask copy behind the pass's budget-0.10 gap on the paper
Llama was found (docs/remat.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _examples import load_example
from bench_remat import example_loss  # same loss as the benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["llama", "bert"], default="llama")
    parser.add_argument("--paper", action="store_true", help="the paper's 32-layer configuration")
    parser.add_argument("--budget", type=float, required=True)
    parser.add_argument("--remat", choices=["off", "light", "all"], default="light")
    parser.add_argument("-o", "--output", required=True, help="prefix of the .memprof and .json written")
    args = parser.parse_args()
    if not 0.0 <= args.budget <= 1.0:
        parser.error(f"--budget must be in [0, 1], got {args.budget}")

    import torch
    import torch._functorch.config as functorch_config

    import memprof
    import memprof.remat as remat

    example = load_example(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, ids = example.build(example.PAPER if args.paper else example.SMALL, device)
    compiled = torch.compile(model)
    cuda = torch.cuda if device == "cuda" else None

    def step() -> None:
        if args.model == "bert":
            torch.manual_seed(1234)
        example_loss(args.model, compiled, ids).backward()

    functorch_config.activation_memory_budget = args.budget
    remat.reports(clear=True)
    with memprof.capture(meta={"budget": args.budget, "remat": args.remat}) as cap:
        if args.remat != "off":
            with remat.enable(args.remat):
                step()
        else:
            step()
        memprof.step()
        model.zero_grad(set_to_none=False)
        if cuda:
            cuda.synchronize()
            cuda.empty_cache()
            before = cuda.memory_allocated()
            cuda.reset_peak_memory_stats()
        step()
        if cuda:
            cuda.synchronize()
        memprof.step()
    if cuda:
        peak = cuda.max_memory_allocated() - before
    else:  # the capture's exact step-2 peak above what step 1 left live
        steps = {s.step: s for s in cap.steps("cpu")}
        peak = steps[2].peak - steps[1].allocated_at_end
    cap.save(f"{args.output}.memprof")
    reports = [r.to_json() for r in remat.reports(clear=True)]
    Path(f"{args.output}.json").write_text(json.dumps({"peak_mb": peak / 1e6, "budget": args.budget,
                                                       "remat": args.remat, "reports": reports}, indent=1))
    lines = "; ".join(remat.RematReport.from_json(r).summary() for r in reports) or "no remat report"
    print(f"{args.model} budget {args.budget:g} remat {args.remat}: step peak {peak / 1e6:.1f} MB ({lines})")


if __name__ == "__main__":
    main()
