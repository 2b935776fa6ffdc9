"""Where one `--predict` process spends its time: the budgets' own compiles against the shared part,
and Dynamo's compile-time breakdown (its `compile_times`: trace, joint graph, joint-graph passes,
partitioner, forward and backward compile, lowering, scheduling, codegen).

    python tools/profile_predict.py --budgets 0.05 examples/train_llama.py -- --paper --no-optimizer   # H200
    python tools/profile_predict.py --budgets 0.0,1.0 examples/train_llama.py -- --no-optimizer --steps 2

Runs `memprof.sweep.predict.predict` in this process (the budgets share it as in a sweep's process;
the first is the one the script runs with). Run it on an otherwise idle machine: a sweep's processes
compete for the cores, and its compiles take longer. The last output is the breakdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

T0 = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", required=True, help="comma-separated budgets, the first run with the script")
    p.add_argument("--remat", default=None)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    budgets = [float(b) for b in ns.budgets.split(",") if b.strip()]
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args

    import torch._dynamo.utils as dynamo_utils

    from memprof.sweep.predict import predict

    imported = time.perf_counter() - T0
    t = time.perf_counter()
    results = predict(Path(ns.script), args, budgets, ns.remat)
    total = time.perf_counter() - t
    print(f"imports {imported:.1f} s, predict {total:.1f} s")
    for r in results:
        m = r.measured
        if m is None:
            print(f"budget {r.budget:g}: {r.status}: {r.error}")
            continue
        print(f"budget {r.budget:g}: {r.status}, own {m.own_compile_s:.1f} s, "
              f"shared {m.shared_s:.1f} s, memprof estimate {m.estimates.get('memprof')}")
    print(dynamo_utils.compile_times(repr="str", aggregate=True))
    return 0 if all(r.status == "completed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
