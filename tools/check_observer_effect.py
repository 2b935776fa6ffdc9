"""Does capturing with memprof change the program it measures? Step peaks compiled inside a memprof
capture (its compile hooks on) against compiled outside it (no hooks), and plain torch.

    python tools/check_observer_effect.py --model llama --paper --budgets 0.05,0.10       # H200
    python tools/check_observer_effect.py --model llama --layers 8 --seq 512 --budgets 0.0:0.3:0.02

Each mode runs in its own process, one compile per budget (torch._dynamo.reset between budgets):
- inside: compile in the first captured step (memprof's compile hooks record the plan; Inductor's
  and AOTAutograd's caches are off, as in every memprof capture);
- outside: compile in a warm-up step before the capture starts (stock compile, caches as torch
  sets them), then capture the steps;
- plain (CUDA only): nothing of memprof installed (its Python modules are imported, for the budget
  spec, but no hook, capture or callback); `torch.cuda.max_memory_allocated()` around each step
  minus the memory allocated before it (the paper's reference method, docs/sweep.md).
The step peak is the most allocated during a forward+backward above the step's start (gradients
kept allocated), the last of the measured steps; for inside/outside it comes from the capture and,
on CUDA, also from the allocator's own counters around the same step (so a difference can be told
apart: between modes, the program changed; between a mode's capture and allocator, the measurement).
The last output is the table (bytes; "same" when every column agrees to the byte).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from _examples import ROOT, load_example  # (tools/, on the path as this script's folder)

sys.path.insert(0, str(ROOT))

from memprof.sweep.spec import parse_budgets

MODES = ("inside", "outside", "plain")


def _worker(ns: argparse.Namespace) -> None:
    import dataclasses

    import torch
    import torch._functorch.config as functorch_config

    if ns.no_gc:
        import gc

        gc.disable()
    ex = load_example(ns.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = ex.PAPER if ns.paper else ex.SMALL
    changes = {k: v for k, v in (("layers", ns.layers), ("seq", ns.seq)) if v is not None}
    size = dataclasses.replace(size, **changes)
    cuda = device == "cuda"
    results: list[tuple[float, int, int | None]] = []  # budget, step peak, the allocator's (CUDA)
    for budget in (float(b) for b in ns.budgets.split(",")):
        torch._dynamo.reset()
        model, ids = ex.build(size, device)
        fn = torch.compile(model)
        functorch_config.activation_memory_budget = budget
        allocator: list[int] = []

        def step(fn: Any = fn, model: Any = model, ids: Any = ids, allocator: list[int] = allocator) -> None:
            if cuda:  # what the caching allocator says, around the same step
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            fn(input_ids=ids).last_hidden_state.sum().backward()
            model.zero_grad(set_to_none=False)
            if cuda:
                torch.cuda.synchronize()
                allocator.append(torch.cuda.max_memory_allocated() - base)

        if ns.mode == "plain":
            for _ in range(ns.steps + 1):
                step()
            results.append((budget, allocator[-1], allocator[-1]))
            continue
        import memprof
        from memprof.sweep.measure import measure

        if ns.mode == "outside":
            step()
        with memprof.capture() as cap:
            for _ in range(ns.steps + (1 if ns.mode == "inside" else 0)):
                step()
                memprof.step()
        m = measure(cap, attribution=False)
        results.append((budget, m.step_peaks[-1], allocator[-1] if allocator else None))
    print("RESULT " + json.dumps(results), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", choices=("llama", "bert"), default="llama")
    p.add_argument("--paper", action="store_true", help="the paper's configuration")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--budgets", default="0.05,0.1")
    p.add_argument("--steps", type=int, default=2, help="measured steps after the compiling one")
    p.add_argument("--no-gc", action="store_true",
                   help="turn Python's cyclic garbage collector off in every mode (are cycles freed at other times?)")
    p.add_argument("--worker", choices=MODES, dest="mode", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    ns.budgets = ",".join(f"{b:g}" for b in parse_budgets(ns.budgets))  # the sweep's own spec syntax
    if ns.mode is not None:
        _worker(ns)
        return 0
    import torch

    modes = MODES if torch.cuda.is_available() else MODES[:2]
    argv = [sys.executable, __file__, *sys.argv[1:]]
    procs = {m: subprocess.Popen([*argv, "--worker", m], stdout=subprocess.PIPE, text=True, cwd=ROOT) for m in modes}
    found: dict[str, dict[float, tuple[int, int | None]]] = {}
    for m, proc in procs.items():
        out, _ = proc.communicate()
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(f"check_observer_effect: the {m} worker failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        found[m] = {float(b): (int(v), a) for b, v, a in json.loads(line.removeprefix("RESULT "))}
    # the capture's step peak in each capturing mode, and on CUDA what the allocator says of the same
    # step (max_memory_allocated above the step's start): a difference between modes in the first
    # is the program changing; between a mode's two columns, the measurement
    cols = [(m, 0) for m in modes if m != "plain"]
    if "plain" in modes:
        cols = [c for m in modes if m != "plain" for c in ((m, 0), (m, 1))] + [("plain", 1)]
    print("| budget | " + " | ".join(f"{m} {'allocator' if i else 'capture'} B" for m, i in cols) + " | |")
    print("|" + "---|" * (len(cols) + 2))
    for b in sorted(found[modes[0]]):
        values = [found[m].get(b, (None, None))[i] for m, i in cols]
        print("| " + " | ".join(str(x) for x in [f"{b:g}", *values,
                                                   "same" if len(set(values)) == 1 else "DIFFERENT"]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
