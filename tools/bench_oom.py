"""Follow the OOM section's next step: trace a script that runs out of memory, run the
`memprof sweep --predict` command its OOM section names (as printed), pick the highest budget
predicted to fit (under the section's fit figure), trace the script again at that budget and check
that it runs without an OOM. Prints a table last.

    python tools/bench_oom.py -- examples/train_llama.py --paper --batch 512 --steps 2 --budget 0.05

Everything after `--` is `memprof trace`'s SCRIPT, its arguments and memprof's own options, as a
user would type them; `--budget` is replaced by the chosen one for the followed run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import memprof  # noqa: E402
from memprof._events import Kind  # noqa: E402
from memprof.analysis.units import MB  # noqa: E402
from memprof.sweep.measure import measure  # noqa: E402
from memprof.sweep.result import load_sweep, run_value  # noqa: E402

MEMPROF = [sys.executable, "-m", "memprof"]


def memprof_run(args: list[str], log: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run([*MEMPROF, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    secs = time.perf_counter() - t0
    print(f"memprof {' '.join(args[:1])}: exit {rc} after {secs:.0f} s (log {log})", flush=True)
    return rc, secs


def without_budget(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--budget":
            skip = True
        elif not a.startswith("--budget="):
            out.append(a)
    return out


def oom_of(path: Path) -> dict[str, Any]:
    res = subprocess.run([*MEMPROF, "report", str(path), "--json"], capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        sys.exit(f"memprof report {path} failed: {res.stderr.strip()[-400:]}")
    ooms = json.loads(res.stdout)["ooms"]
    if not ooms:
        sys.exit(f"{path}: the run did not run out of memory; give a larger --batch")
    return dict(ooms[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", type=Path, default=Path("/tmp/memprof_oom"), help="working directory")
    ap.add_argument("trace", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS... (memprof trace's arguments)")
    a = ap.parse_args()
    trace = a.trace[1:] if a.trace[:1] == ["--"] else a.trace
    if not trace:
        ap.error("give memprof trace's SCRIPT and arguments after --")
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str]] = []

    first = a.out / "oom.memprof"
    rc, secs = memprof_run(["trace", "--force", "-o", str(first), *trace], a.out / "oom.log")
    oom = oom_of(first)
    cap = memprof.load(first)
    live = sum(r["bytes"] for r in oom["by_category"])
    rows += [("traced (OOM)", f"exit {rc}, {secs:.0f} s, status {cap.meta.get('status')}"),
             ("failed request", f"{oom['requested_bytes']:,} B on {oom['device']}, {oom['free_bytes']:,} B free"),
             ("live rows / allocated at the OOM", f"{live:,} / {oom['allocated_bytes']:,} B"),
             ("fit (free + this step's bytes)", f"{oom['fit_bytes'] / MB:,.1f} MB")]
    command = oom["sweep_command"]
    if not command:
        sys.exit("the OOM section names no sweep (no activations live, or no plans recorded)")
    print("next step:", " ".join(command), flush=True)

    sweep_dir = a.out / "sweep"
    rc, secs = memprof_run([*command[1:], "-o", str(sweep_dir), "--force", "--no-plot"], a.out / "sweep.log")
    result = load_sweep(sweep_dir / "sweep.json")
    predicted = {r.budget: run_value(r, "predict") for r in result.runs_of("stock")}
    rows.append((f"`{' '.join(command[1:3])} ... --predict --jobs {command[-1]}`", f"exit {rc}, {secs:.0f} s"))
    rows += [(f"  predicted at {b:g}", "failed" if p is None else f"{p / MB:,.1f} MB")
             for b, p in sorted(predicted.items())]
    fitting = [b for b, p in predicted.items() if p is not None and p <= oom["fit_bytes"]]
    if not fitting:
        rows.append(("chosen budget", "none is predicted to fit"))
    else:
        budget = max(fitting)
        second = a.out / "followed.memprof"
        rc, secs = memprof_run(["trace", "--force", "-o", str(second), *without_budget(trace),
                                "--budget", f"{budget:g}"], a.out / "followed.log")
        cap = memprof.load(second)
        ooms = int((cap.raw["kind"] == Kind.OOM).sum())
        dev = oom["device"]
        m = measure(cap, dev, attribution=False)
        rows += [("chosen budget (highest predicted to fit)", f"{budget:g}"),
                 ("followed run", f"exit {rc}, {secs:.0f} s, status {cap.meta.get('status')}, {ooms} OOM events"),
                 ("  its peak; step peaks (the sweep's measure)", f"{cap.peak(dev) / MB:,.1f} MB; "
                  + ", ".join(f"{p / MB:,.1f}" for p in m.step_peaks) + " MB")]
    print()
    print("| what | figure |\n|---|---|")
    for what, fig in rows:
        print(f"| {what} | {fig} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
