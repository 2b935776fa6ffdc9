"""What capturing costs on the CPU, as a hostile user measures it: a loop of `torch.empty(4)` allocations
and frees (4 events per iteration with op scopes: alloc, free, and aten::empty's begin and end), run as
a plain script and under `memprof trace` in rotating rounds, each run its own process. Then what
saving and reading the capture cost: the same loop under `memprof.capture(output=...)` (the time and
memory from the loop's end to the file on disk), and `memprof report` on the capture written.

    python tools/bench_cpu_capture.py --iterations 2000000 --rounds 3
    python tools/bench_cpu_capture.py --instructions      # needs valgrind: instructions an iteration

Per run: the loop's own seconds (printed by the script), the whole process's seconds, its peak
memory (`wait4`), how far its memory rose while the loop ran above where it began (sampled by the
script every 65,536 iterations), the events the capture kept and dropped. Prints a table last: medians
and the ratio to plain.

`--instructions` counts instead the instructions one iteration executes (valgrind's callgrind),
plain, under `--scopes none` and under the default op scopes, in process: the difference between
a run of N and one of N + 200,000 iterations, over 200,000 (the start, the import and the capture's
setup cancel), with Python's string hashing fixed (`PYTHONHASHSEED=0`). The wall clock swings by a
third between runs on a shared 2-core machine; the count moves far less (see docs/benchmarks.md),
so a change of a few percent in the per-event path shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from memprof.spill import DEFLATE_ENV, deflates_while_running

DEFAULT = int(deflates_while_running())  # (on this machine, with no variable set)

SCRIPT = '''\
import json, os, sys, time
import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def loop(n: int) -> dict:
    start = top = rss()
    t0 = time.perf_counter()
    for i in range(n):
        t = torch.empty(4)
        del t
        if not i & 0xFFFF:
            top = max(top, rss())
    return {"loop_s": time.perf_counter() - t0, "rise": max(top, rss()) - start, "end_rss": rss()}


n, mode = int(sys.argv[1]), sys.argv[2]
loop(1000)
if mode == "api":  # the loop inside memprof.capture(output=...): what the save costs
    import resource
    import memprof
    with memprof.capture(output=sys.argv[3], overwrite=True):
        out = loop(n)
        t_end = time.perf_counter()
    out["save_s"] = time.perf_counter() - t_end
    out["save_above"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - out["end_rss"]
else:
    out = loop(n)
print("BENCH " + json.dumps(out), flush=True)
'''


def run(cmd: list[str], cwd: Path, deflate: str = "") -> dict[str, float]:
    """One process of `cmd`; `deflate` "1" or "0" sets whether the spill deflates while the script runs
    (`memprof.spill.DEFLATE_ENV`; "" leaves it to the core count)."""
    env = {k: v for k, v in os.environ.items() if k != DEFLATE_ENV} | ({DEFLATE_ENV: deflate} if deflate else {})
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (status {status})")
    line = next(ln for ln in out.splitlines() if ln.startswith("BENCH "))
    return {**json.loads(line[6:]), "wall_s": wall, "maxrss": usage.ru_maxrss * 1024}


INSTRUCTIONS_SCRIPT = """\
import sys
import torch
import memprof

def loop(n):
    for _ in range(n):
        t = torch.empty(4)
        del t

n, scopes = int(sys.argv[1]), sys.argv[2]
loop(1000)
if scopes == "plain":
    loop(n)
else:
    with memprof.capture(scopes=scopes):
        loop(n)
"""


def instructions(directory: Path, n: int, variant: str) -> int:
    """The instructions (callgrind's `Ir`) of one process running `n` iterations as `variant`."""
    out = directory / f"callgrind.{variant}.{n}"
    proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                           str(directory / "count.py"), str(n), variant], capture_output=True, text=True,
                          env=os.environ | {"PYTHONHASHSEED": "0"})
    totals = [ln for ln in proc.stderr.splitlines() if "Collected :" in ln]
    if proc.returncode != 0 or not totals:
        raise SystemExit(f"valgrind on {variant} failed (status {proc.returncode}): {proc.stderr[-300:]}")
    return int(totals[-1].split(":")[-1].strip())


def count_instructions() -> None:
    """Instructions an iteration, plain, `--scopes none` and the default scopes (one process each)."""
    import shutil

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt install valgrind)")
    base, more = 20_000, 220_000
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "count.py").write_text(INSTRUCTIONS_SCRIPT)
        per = {v: (instructions(d, more, v) - instructions(d, base, v)) / (more - base)
               for v in ("plain", "none", "ops")}
    print(f"torch {__import__('torch').__version__}; instructions an iteration of `torch.empty(4); del t` "
          f"(callgrind, {more:,} - {base:,} iterations)")
    print(f"{'variant':<28} {'instructions':>12} {'ratio':>6}")
    for v, name in (("plain", "plain"), ("none", "capture, --scopes none"), ("ops", "capture (default scopes)")):
        print(f"{name:<28} {per[v]:>12,.0f} {per[v] / per['plain']:>6.3f}")


def kept(path: Path) -> tuple[int, int]:
    """(events kept, events dropped) of a saved capture, from its metadata and array header only."""
    with zipfile.ZipFile(path) as zf:
        meta = json.loads(zf.read("meta.json"))
        with zf.open("events.npy") as fh:
            import numpy as np

            major, _ = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape = read(fh)[0]
    return int(shape[0]), int(meta.get("dropped_events") or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2_000_000, help="loop iterations (4 events each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions an iteration under valgrind instead of timing processes")
    args = parser.parse_args()
    if args.instructions:
        count_instructions()
        return
    # memprof's bytecode, as an install has it: with PYTHONDONTWRITEBYTECODE set (this machine sets
    # it) every `memprof trace` would compile memprof's modules from source, 0.15-0.25 s a process
    import compileall

    import memprof

    compileall.compile_dir(str(Path(memprof.__file__).parent), quiet=1)
    py, n = sys.executable, str(args.iterations)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "loop.py").write_text(SCRIPT)
        trace = [py, "-m", "memprof", "trace"]
        variants = {  # (command, deflate while running)
            "plain": ([py, "loop.py", n, "plain"], ""),
            "trace": ([*trace, "loop.py", n, "plain", "-o", "t.memprof", "--force"], ""),
            f"trace, {DEFLATE_ENV[8:].lower()}={1 - DEFAULT}": (
                [*trace, "loop.py", n, "plain", "-o", "o.memprof", "--force"], str(1 - DEFAULT)),
            "trace --scopes none": ([*trace, "--scopes", "none", "loop.py", n, "plain", "-o", "n.memprof", "--force"],
                                    ""),
        }
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        names = list(variants)
        for r in range(args.rounds):
            for v in names[r % len(names):] + names[: r % len(names)]:
                runs[v].append(run(variants[v][0], d, variants[v][1]))
        events = {v: kept(d / variants[v][0][-2]) for v in names[1:]}
        saves = {flag: [run([py, "loop.py", n, "api", "a.memprof"], d, flag) for _ in range(args.rounds)]
                 for flag in ("1", "0")}
        reports = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            proc = subprocess.Popen([py, "-m", "memprof", "report", "t.memprof"], cwd=d, stdout=subprocess.DEVNULL)
            _, status, usage = os.wait4(proc.pid, 0)
            if status != 0:
                raise SystemExit(f"memprof report failed (status {status})")
            reports.append((time.perf_counter() - t0, usage.ru_maxrss * 1024))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    plain = med["plain"]
    print(f"torch {__import__('torch').__version__}; {args.iterations:,} iterations, {args.rounds} rounds (medians); "
          f"{len(os.sched_getaffinity(0))} cores: the spill deflates "
          f"{'while the script runs' if DEFAULT else 'at the save'} by default")
    print(f"{'variant':<30} {'loop s':>7} {'ratio':>6} {'process s':>9} {'ratio':>6} {'peak MB':>8} "
          f"{'rise in loop MB':>15} {'events':>11} {'dropped':>8}")
    for v, m in med.items():
        kept_n, dropped = events.get(v, (0, 0))
        print(f"{v:<30} {m['loop_s']:>7.2f} {m['loop_s'] / plain['loop_s']:>6.2f} {m['wall_s']:>9.2f} "
              f"{m['wall_s'] / plain['wall_s']:>6.2f} {m['maxrss'] / 1e6:>8.0f} {m['rise'] / 1e6:>15.1f} "
              f"{kept_n if v != 'plain' else 0:>11,} {dropped:>8,}")
    for flag, runs_ in saves.items():
        save_s = statistics.median(s["save_s"] for s in runs_)
        above = statistics.median(s["save_above"] for s in runs_)
        print(f"save (memprof.capture(output=...), loop end to file), {DEFLATE_ENV}={flag}: {save_s:.2f} s, peak "
              f"{above / 1e6:.0f} MB above the running process")
    rep_s, rep_rss = statistics.median(r[0] for r in reports), statistics.median(r[1] for r in reports)
    print(f"memprof report on the trace's capture ({events['trace'][0]:,} events): {rep_s:.2f} s, "
          f"peak {rep_rss / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
