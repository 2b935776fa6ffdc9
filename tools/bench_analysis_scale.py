"""What reading a capture costs against its event count: captures of a `torch.empty(4)` loop (4 events
an iteration with op scopes) at 100 k, 1 M and 10 M events, made with `memprof trace`; then, each in
a fresh process, the phases of the analysis timed one after another (load, timeline, labels,
attribution at the peak, the text summary) and `memprof report` as a user runs it (wall time and
peak memory from `wait4`). Prints a table last.

    python tools/bench_analysis_scale.py --events 100000,1000000,10000000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOP = "import sys, torch\nfor _ in range(int(sys.argv[1])):\n    t = torch.empty(4)\n    del t\n"

PHASES = '''\
import json, sys, time
t0 = time.perf_counter()
import memprof
from memprof.analysis.summary import summarize
out = {}
t = time.perf_counter(); cap = memprof.load(sys.argv[1]); out["load"] = time.perf_counter() - t
t = time.perf_counter(); cap.timeline("cpu"); out["timeline"] = time.perf_counter() - t
t = time.perf_counter(); cap.labels("cpu"); out["labels"] = time.perf_counter() - t
t = time.perf_counter(); cap.attribution(device="cpu"); out["attribution"] = time.perf_counter() - t
t = time.perf_counter(); summarize(cap); out["summary"] = time.perf_counter() - t
out["events"] = len(cap.raw)
print("BENCH " + json.dumps(out), flush=True)
'''


def timed(cmd: list[str], cwd: Path) -> tuple[float, int, str]:
    """(wall seconds, peak memory in bytes, stdout) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (status {status})")
    return time.perf_counter() - t0, usage.ru_maxrss * 1024, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", default="100000,1000000,10000000", help="event counts, comma-separated")
    args = parser.parse_args()
    py = sys.executable
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "loop.py").write_text(LOOP)
        (d / "phases.py").write_text(PHASES)
        for n in (int(x) for x in args.events.split(",")):
            timed([py, "-m", "memprof", "trace", "loop.py", str(n // 4), "-o", "c.memprof", "--force"], d)
            size = (d / "c.memprof").stat().st_size
            _, _, out = timed([py, "phases.py", "c.memprof"], d)
            phases = json.loads(next(ln for ln in out.splitlines() if ln.startswith("BENCH "))[6:])
            wall, rss, _ = timed([py, "-m", "memprof", "report", "c.memprof"], d)
            rows.append((phases, size, wall, rss))
    print(f"torch {__import__('torch').__version__}; one process per measurement")
    print(f"{'events':>11} {'file MB':>8} {'load s':>7} {'timeline s':>10} {'labels s':>8} {'attrib s':>8} "
          f"{'summary s':>9} {'report s':>8} {'report MB':>9} {'MB/M ev':>8}")
    for phases, size, wall, rss in rows:
        print(f"{phases['events']:>11,} {size / 1e6:>8.1f} {phases['load']:>7.2f} {phases['timeline']:>10.2f} "
              f"{phases['labels']:>8.2f} {phases['attribution']:>8.2f} {phases['summary']:>9.2f} {wall:>8.2f} "
              f"{rss / 1e6:>9.0f} {rss / 1e6 / (phases['events'] / 1e6):>8.0f}")


if __name__ == "__main__":
    main()
