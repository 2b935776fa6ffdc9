"""`memprof sweep --predict`: one budget's compile-time prediction, with no training step.

Run as `python -m memprof.sweep.predict --budget B [--remat MODE] --json OUT SCRIPT -- ARGS` (the
sweep starts one per budget). The script runs under memprof's compile hooks (no allocation
capture) with `torch._functorch.config.force_non_lazy_backward_lowering`, so each compiled
region's backward is partitioned and compiled together with its forward; the first call of
`Tensor.backward` / `torch.autograd.backward` then stops the script (a script that only calls
`torch.autograd.grad` runs to its end). What
ran is the compile and one forward; no backward and no optimizer step. The predictions are those
of `memprof.sweep.measure.estimates` (memprof's walk of the wrapper code, Inductor's estimate).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


class _Stop(BaseException):
    """Raised at the first backward call: everything it needs has been compiled."""


def predict(script: Path, args: list[str], budget: float, remat: str | None) -> dict[str, Any]:
    import contextlib

    import torch
    import torch._functorch.config as functorch_config

    from memprof.compile_hooks import PlanRecorder
    from memprof.runner import run_script
    from memprof.sweep.measure import estimates, merge_facts, plan_facts

    notes: list[str] = []
    functorch_config.activation_memory_budget = budget
    functorch_config.force_non_lazy_backward_lowering = True
    recorder = PlanRecorder(time.perf_counter_ns, notes.append, knapsack_evaluator=True)
    originals = (torch.Tensor.backward, torch.autograd.backward)

    def stop(*_a: Any, **_k: Any) -> Any:
        raise _Stop()

    remat_ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if remat:
        from memprof.remat import enable

        remat_ctx = enable(remat)
    t0 = time.perf_counter()
    with remat_ctx:
        recorder.install()
        # not torch.autograd.grad: AOTAutograd traces the joint graph with it
        torch.Tensor.backward = stop  # type: ignore[method-assign]
        torch.autograd.backward = stop
        try:
            result = run_script(script, args, stop=_Stop)
        finally:
            torch.Tensor.backward, torch.autograd.backward = originals  # type: ignore[method-assign]
            recorder.uninstall()
    seconds = time.perf_counter() - t0
    plans, graphs = recorder.plans, recorder.graphs
    device = "cuda" if any("empty_strided_cuda" in g.source for g in graphs) else "cpu"
    found, walk = estimates(plans, graphs, device)
    phase, at_peak = (walk.phase, walk.at_peak) if walk else ("", {})
    facts = merge_facts([plan_facts(p) for p in plans])
    ok = result.status in ("stopped", "completed", "exit") and result.exit_code == 0
    status = "completed" if ok else result.status
    return {
        "meta": {"status": status, "exit_code": result.exit_code, "error": result.error, "budget": budget,
                 "remat": remat or "off", "stopped_at_backward": result.status == "stopped"},
        "measured": {
            "device": device, "step_peak": None, "compiled": bool(plans), "plans": len(plans),
            "facts": None if facts is None else facts.__dict__, "estimates": found, "compile_s": round(seconds, 2),
            "notes": notes, "step_ms": None, "buffer_level": bool(graphs),
            # no capture: what is live at the peak is memprof's estimate's (the step's own allocations)
            "at_peak": at_peak, "peak_phase": phase, "at_peak_source": "estimate",
            "estimate_at_peak": at_peak, "estimate_peak_phase": phase,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memprof.sweep.predict")
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--remat", default=None)
    p.add_argument("--json", required=True)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    out = predict(Path(ns.script), args, ns.budget, ns.remat)
    Path(ns.json).write_text(json.dumps(out))
    print(f"memprof: predicted budget {ns.budget:g}: {out['measured']['estimates']} "
          f"({out['measured']['compile_s']:.1f} s)", file=sys.stderr)
    return 0 if out["meta"]["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
