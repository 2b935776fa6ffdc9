"""The spill: a `memprof trace` killed with SIGKILL leaves what it recorded up to at most about a
second before the kill, and `memprof report` on the output recovers it and says it is cut short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import memprof
from memprof._events import Kind

from ..conftest import invoke_memprof, one_line_error

SCRIPT = ("import torch\n"
          "keep = []\n"
          "for i in range(400_000):\n"
          "    keep.append(torch.empty(64 + i % 7))\n"
          "    if len(keep) > 50:\n"
          "        keep.pop(0)\n")


def _alloc_sequence(cap: memprof.Capture) -> np.ndarray:
    """The sizes of the allocations and frees, in order (the script runs on one thread)."""
    raw = cap.raw
    return np.asarray(raw["bytes"][np.isin(raw["kind"], [Kind.ALLOC, Kind.FREE])])


def test_a_killed_trace_is_recovered_from_its_spill(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    full = subprocess.run([sys.executable, "-m", "memprof", "trace", "train.py", "-o", "full.memprof"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr
    assert not (tmp_path / "full.memprof.spill").exists()  # a saved capture leaves no spill
    proc = subprocess.Popen([sys.executable, "-m", "memprof", "trace", "train.py", "-o", "run.memprof"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spill = tmp_path / "run.memprof.spill"
    deadline = time.monotonic() + 120
    while (not spill.exists() or spill.stat().st_size < 8_000_000) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed_at = time.monotonic_ns()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (tmp_path / "run.memprof").exists() and spill.exists()
    cap = memprof.load(tmp_path / "run.memprof")
    assert not cap.exact and "cut short" in cap.caveats[0] and cap.info.status == "cut short"
    assert int(cap.raw["t_ns"].max()) >= killed_at - 1_000_000_000  # at most ~1 s lost
    got, whole = _alloc_sequence(cap), _alloc_sequence(memprof.load(tmp_path / "full.memprof"))
    assert 1000 < len(got) < len(whole) and np.array_equal(got, whole[: len(got)])  # the run's own events
    report = invoke_memprof("report", "run.memprof", cwd=tmp_path)
    assert report.returncode == 0 and "INCOMPLETE: the run was cut short" in report.stdout
    # the spill is the only copy: a new trace to the same output keeps it unless --force
    line = one_line_error(invoke_memprof("trace", "train.py", "-o", "run.memprof", cwd=tmp_path))
    assert "spill of an earlier run" in line and spill.exists()
    forced = invoke_memprof("trace", "train.py", "-o", "run.memprof", "--force", cwd=tmp_path)
    assert forced.returncode == 0 and not spill.exists() and memprof.load(tmp_path / "run.memprof").exact


def test_a_streaming_capture_holds_about_one_chunk_and_loses_nothing(tmp_path: Path) -> None:
    """While a capture with an output runs, the native store frees what the spill has on disk: its
    memory stays about one chunk (1.8 MB) however long the run; the saved capture still holds every
    event, the same as a capture kept in memory."""
    import torch

    from memprof._native import native

    def loop(n: int) -> None:
        keep = []
        for i in range(n):
            keep.append(torch.empty(16 + i % 5))
            if len(keep) > 20:
                keep.pop(0)

    with memprof.capture() as in_ram:
        for _ in range(6):
            loop(10_000)
    held, released = [], 0
    with memprof.capture(output=tmp_path / "run.memprof") as streamed:
        for _ in range(6):
            loop(10_000)
            time.sleep(0.6)  # a flush of the spill
            held.append(native().store_bytes())
        released = native().released_events()
    assert released > 100_000 and max(held) <= 2 * (1 << 15) * 56, (released, held)
    assert not (tmp_path / "run.memprof.spill").exists()
    saved = memprof.load(tmp_path / "run.memprof")
    assert np.array_equal(_alloc_sequence(saved), _alloc_sequence(in_ram))
    assert len(saved.raw) == len(streamed.raw) and streamed.peak("cpu") == in_ram.peak("cpu")
