"""Long runs: the bundled example traced for thousands of steps in full, with a ring of the last
steps (`--keep-last`) and with a step window (`--steps`), each an unmodified `memprof trace` process.

For each run: wall time, peak RSS and RSS growth after step `--after` (the process's RSS sampled
every 50 ms; step `--after` is when the script prints that it ended), the file's size,
and `memprof report` time on it (median of 3). Then the ring's and the window's attribution
at each of their complete steps' peaks against the full capture's, by category, node, layer and
kernel (equal: every row, bytes and count). Prints a table last.

    python tools/bench_long_runs.py --steps 3000 --keep-last 20 --window 10:12
    python tools/bench_long_runs.py --steps 5000 --keep-last 20 --no-full   # report time of a long ring
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import memprof  # noqa: E402

BY = ("category", "node", "layer", "kernel")


@dataclass
class Run:
    name: str
    args: list[str]
    wall_s: float = 0.0
    rss: list[tuple[int, int]] = field(default_factory=list)  # (monotonic ns, bytes)
    step_ns: dict[int, int] = field(default_factory=dict)  # step -> when the script printed its end
    path: Path | None = None


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trace(run: Run, out: Path, steps: int, device: str) -> None:
    run.path = out / f"{run.name}.memprof"
    cmd = [sys.executable, "-m", "memprof", "trace", *run.args, "-o", str(run.path), "--force",
           str(ROOT / "examples" / "train_llama.py"), "--", "--steps", str(steps), "--device", device]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def steps() -> None:  # "step N: loss ..." as the example prints each step
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step ") and ":" in line:
                run.step_ns[int(line[5:line.index(":")])] = time.monotonic_ns()

    reader = threading.Thread(target=steps, daemon=True)
    reader.start()
    while proc.poll() is None:
        run.rss.append((time.monotonic_ns(), _rss(proc.pid)))
        time.sleep(0.05)
    reader.join()
    run.wall_s = time.monotonic() - t0
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        sys.exit(f"{run.name}: memprof trace failed ({proc.returncode}): {err.strip().splitlines()[-1:]}")


def report_s(path: Path) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memprof", "report", str(path)], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def growth_after(run: Run, after: int) -> tuple[int, int]:
    """(peak RSS, RSS growth from the end of step `after` to the process's end)."""
    t = run.step_ns.get(after, 0)
    later = [b for ns, b in run.rss if ns >= t and b]
    before = [b for ns, b in run.rss if ns <= t and b]
    base = before[-1] if before else (later[0] if later else 0)
    return max(b for _, b in run.rss), (max(later) - base) if later else 0


def compare(full: memprof.Capture, part: memprof.Capture) -> tuple[int, int]:
    """(steps compared, rows that differ) over every complete step the part holds."""
    steps = [s.step for s in part.steps() if s.complete]
    differ = 0
    for step in steps:
        for by in BY:
            want = sorted((r.key, r.bytes, r.count) for r in full.attribution(at=f"step:{step}", by=by))
            got = sorted((r.key, r.bytes, r.count) for r in part.attribution(at=f"step:{step}", by=by))
            differ += len(set(want) ^ set(got))
    return len(steps), differ


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--keep-last", type=int, default=20)
    p.add_argument("--window", default="10:12")
    p.add_argument("--after", type=int, default=100, help="RSS growth is measured from this step's end")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-full", action="store_true", help="skip the full capture (and the comparisons)")
    args = p.parse_args()
    runs = [Run("ring", ["--keep-last", str(args.keep_last)]), Run("window", ["--steps", args.window])]
    if not args.no_full:
        runs.insert(0, Run("full", []))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        caps: dict[str, memprof.Capture] = {}
        for run in runs:
            trace(run, Path(tmp), args.steps, args.device)
            assert run.path is not None
            caps[run.name] = memprof.load(run.path)
        for run in runs:
            assert run.path is not None
            cap = caps[run.name]
            peak, growth = growth_after(run, args.after)
            compared = compare(caps["full"], cap) if "full" in caps and run.name != "full" else None
            rows.append((run.name, " ".join(run.args) or "(all steps)", run.wall_s, peak, growth,
                         run.path.stat().st_size, report_s(run.path), compared))
    print(f"\nthe bundled example (train_llama.py, {args.device}), {args.steps} steps, memprof trace each way")
    print(f"{'run':<8} {'stores':<16} {'wall s':>8} {'peak RSS MB':>12} {'RSS growth MB':>14} {'file MB':>9} "
          f"{'report s':>9}  attribution vs full")
    for name, what, wall, peak, growth, size, rep, compared in rows:
        versus = "-" if compared is None else f"{compared[0]} steps x {len(BY)} groupings: {compared[1]} rows differ"
        print(f"{name:<8} {what:<16} {wall:>8.1f} {peak / 1e6:>12.1f} {growth / 1e6:>14.1f} {size / 1e6:>9.2f} "
              f"{rep:>9.2f}  {versus}")


if __name__ == "__main__":
    main()
