"""Does memprof change what Dynamo compiles? Runs a script plainly and under `memprof trace`, side by
side (two processes at once), and prints Dynamo's counters for each: graphs compiled, frames,
recompiles, graph breaks. Equal rows mean the capture added no guard and no recompile.

    python tools/check_recompiles.py examples/train_llama.py --vary-seq --steps 6
    python tools/check_recompiles.py examples/train_llama.py --paper --vary-seq --steps 8   # on the GPU
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the child prints Dynamo's counters at exit, however the script ends (memprof trace calls sys.exit)
_CHILD = r"""
import atexit, json, runpy, sys
from torch._dynamo.utils import counters
def report():
    stats = {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break") and v}
    print("MEMPROF_COUNTERS " + json.dumps(stats), flush=True)
atexit.register(report)
mode, script, out, *args = sys.argv[1:]
if mode == "plain":
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
else:
    from memprof.cli import main
    main(["trace", script, "-o", out, "--force", "--", *args])
"""


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    out = Path(tempfile.mkdtemp()) / "check.memprof"
    t0 = time.perf_counter()
    procs = {mode: subprocess.Popen([sys.executable, "-c", _CHILD, mode, script, str(out), *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in ("plain", "memprof")}
    rows = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate()
        line = next((ln for ln in stdout.splitlines() if ln.startswith("MEMPROF_COUNTERS ")), None)
        if line is None:
            print(f"{mode}: no counters (exit {proc.returncode}):\n{stderr[-2000:]}", file=sys.stderr)
            return 1
        rows[mode] = (json.loads(line.split(" ", 1)[1]), proc.returncode, time.perf_counter() - t0)
    print(f"{'run':<8} {'exit':>4} {'graphs':>6} {'frames':>6} {'recompiles':>10} {'breaks':>6} {'ended after':>11}")
    for mode, (c, rc, wall) in rows.items():
        stats = c.get("stats", {})
        print(f"{mode:<8} {rc:>4} {stats.get('unique_graphs', 0):>6} {stats.get('calls_captured', 0):>6} "
              f"{sum(c.get('recompiles', {}).values()):>10} {sum(c.get('graph_break', {}).values()):>6} {wall:>10.1f}s")
    same = rows["plain"][0] == rows["memprof"][0]
    if not same:
        for group in sorted(set(rows["plain"][0]) | set(rows["memprof"][0])):
            a, b = rows["plain"][0].get(group, {}), rows["memprof"][0].get(group, {})
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    print(f"  {group}.{key}: plain {a.get(key)}, memprof {b.get(key)}")
    print("same counters" if same else "COUNTERS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
