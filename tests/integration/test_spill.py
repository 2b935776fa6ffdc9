"""The spill: a `memprof trace` killed with SIGKILL leaves what it recorded up to at most about a
second before the kill, and `memprof report` on the output recovers it and says it is cut short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

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


def test_a_streaming_capture_holds_a_few_chunks_and_loses_nothing(tmp_path: Path) -> None:
    """While a capture with an output runs, the native store frees what the spill has on disk: its
    memory stays a few chunks (1.8 MB each: those not written yet, at most 8 before the spill is
    written, and at most 8 kept for reuse) however long the run; the saved capture still holds every
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
    assert released > 100_000 and max(held) <= (2 * 8 + 2) * (1 << 15) * 56, (released, held)
    assert not (tmp_path / "run.memprof.spill").exists()
    saved = memprof.load(tmp_path / "run.memprof")
    assert np.array_equal(_alloc_sequence(saved), _alloc_sequence(in_ram))
    assert len(saved.raw) == len(streamed.raw) and streamed.peak("cpu") == in_ram.peak("cpu")


def test_a_streaming_capture_has_no_event_bound_unless_given_one(tmp_path: Path) -> None:
    """Streamed to its spill, a capture keeps every event however many (the file records no bound); held
    in memory it keeps the default bound; an explicit bound is the user's and holds either way."""
    import torch

    from memprof.recorder import DEFAULT_MAX_EVENTS

    with memprof.capture(output=tmp_path / "streamed.memprof") as streamed:
        torch.empty(8)
    with memprof.capture() as in_ram:
        torch.empty(8)
    with memprof.capture(output=tmp_path / "bounded.memprof", max_events=500) as bounded:
        for _ in range(1000):
            torch.empty(8)
    assert streamed.info.max_events == 0 and not streamed.dropped
    assert memprof.load(tmp_path / "streamed.memprof").info.max_events == 0
    assert in_ram.info.max_events == DEFAULT_MAX_EVENTS
    assert len(bounded.raw) == 500 and bounded.dropped > 1000 and not bounded.exact


def test_a_spill_that_fills_the_disk_bounds_the_store_and_keeps_what_it_wrote(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The spill's disk fills mid-run (its descriptor turned to /dev/full): one warning line says after
    how many events, the script goes on, the store keeps a bounded number more in memory and counts the
    rest as dropped, and the saved capture holds every event up to there, in order."""
    import torch

    from memprof import recorder

    with memprof.capture(output=tmp_path / "run.memprof") as cap:
        rec = recorder.current()
        assert rec is not None and rec.spill is not None
        rec.spill.bound_on_failure = 5000
        for _ in range(20_000):
            torch.empty(8)
        time.sleep(0.6)  # a flush that writes
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, rec.spill._fd)
        os.close(full)
        for _ in range(20_000):
            torch.empty(8)
        time.sleep(0.6)  # a flush that fails: what the store holds stays, 5000 more may come
        for _ in range(20_000):
            torch.empty(8)
    warning = [line for line in capsys.readouterr().err.splitlines() if "could not be written" in line]
    assert len(warning) == 1 and "No space left on device" in warning[0], warning
    written = int(warning[0].split(" after ")[1].split(" events")[0].replace(",", ""))
    assert written >= 80_000 and cap.dropped > 70_000 and not cap.exact
    assert len(cap.raw) == cap.info.max_events and 160_000 + 5000 <= len(cap.raw) <= 160_000 + 5000 + 100
    saved = memprof.load(tmp_path / "run.memprof")
    assert len(saved.raw) == len(cap.raw) and np.array_equal(saved.raw["t_ns"], cap.raw["t_ns"])
    assert bool((np.diff(saved.raw["t_ns"]) >= 0).all())


def test_a_streamed_capture_is_saved_from_its_spill_without_reading_it_into_memory(tmp_path: Path) -> None:
    """Stopping and saving a capture whose events went to its spill streams them into the file a record
    at a time: Python's allocations stay far below the events' size (22 MB here); the events are read
    into memory only when first used, and equal what the file holds."""
    import tracemalloc

    import torch

    with memprof.capture(output=tmp_path / "run.memprof") as cap:
        for _ in range(100_000):
            torch.empty(8)
        time.sleep(0.6)  # a flush of the spill: the store frees what it wrote
        tracemalloc.start()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert not (tmp_path / "run.memprof.spill").exists()
    events = len(cap.raw)
    assert events >= 400_000 and peak < 8 << 20, (events, peak)  # (the events: 22.4 MB)
    saved = memprof.load(tmp_path / "run.memprof")
    assert np.array_equal(saved.raw, cap.raw) and saved.peak("cpu") == cap.peak("cpu")


def test_a_streamed_capture_lets_go_of_the_known_tensors_its_spill_holds(tmp_path: Path) -> None:
    """Every step's gradients are new blocks (zero_grad(set_to_none=True)), a record each: once the spill
    holds them the recorder lets them go (a long run would hold them all), and the capture and its file
    still have every one, in order, naming each step's blocks."""
    import torch

    from memprof import recorder

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def steps(n: int) -> None:
        for _ in range(n):
            model(torch.randn(4, 8)).sum().backward()
            seen.extend((p.grad.untyped_storage().data_ptr(), p.grad.untyped_storage().nbytes())
                        for p in model.parameters())
            opt.step()
            opt.zero_grad(set_to_none=True)

    with memprof.capture(output=tmp_path / "run.memprof", scopes="none") as cap:
        rec = recorder.current()
        assert rec is not None and rec.spill is not None and rec.plan_recorder is not None
        steps(30)
        time.sleep(0.6)  # a flush of the spill
        known = rec.plan_recorder.tensors
        assert known.released >= 30 * 4 and len(known) - known.released < 30 * 4, (known.released, len(known))
        with pytest.raises(IndexError, match="let go"):
            known[0]
        steps(10)
    grads = [(t.ptr, t.bytes) for t in cap.tensors if t.category == "gradient"]
    assert grads == seen
    assert memprof.load(tmp_path / "run.memprof").tensors == cap.tensors


def test_what_runs_beside_the_save_reads_the_events_as_the_save_writes_them(tmp_path: Path) -> None:
    """`memprof trace` makes its summary on a thread of its own while the capture is saved from the
    spill: both read the spilled events at once (at offsets, one descriptor), each gets all of them,
    and the thread has ended when the session has."""
    import threading

    import torch

    from memprof.session import session

    seen: list[tuple[int, str]] = []

    def beside(cap: memprof.Capture) -> None:
        seen.append((len(cap.raw), threading.current_thread().name))

    with session(output=tmp_path / "run.memprof", beside_save=beside) as cap:
        for _ in range(50_000):
            torch.empty(8)
        time.sleep(0.6)  # a flush of the spill: most events are read back from it
    assert seen == [(len(cap.raw), "memprof-beside-save")] and len(cap.raw) >= 200_000
    assert not any(t.name == "memprof-beside-save" for t in threading.enumerate())
    saved = memprof.load(tmp_path / "run.memprof")
    assert np.array_equal(saved.raw, cap.raw)
    assert not (tmp_path / "run.memprof.spill").exists()


def test_the_save_copies_the_events_the_spill_deflated_while_the_script_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spill deflates the events it writes, beside the script (its `Z` records): the save copies that
    stream after the array's header instead of deflating the events again, and the file holds every
    event, the tail the store kept after the last write included, under zipfile's own CRC check. A ring,
    whose spill is written anew, and a process with few cores (where deflating beside the script would
    slow it) deflate at the save."""
    import zipfile

    import torch

    from memprof import deflate, fileformat, recorder, spill
    from memprof.spill_read import index_records

    used: list[bool] = []  # per save: whether it copied the spill's stream (else it deflated the events)

    def spy(member: object, head: bytes, pieces: Iterable[bytes], body: deflate.Digest) -> bool:
        done = deflate.write_deflated(member, head, pieces, body)  # type: ignore[arg-type]
        used.append(done and isinstance(body, deflate.Deflated))
        return done

    monkeypatch.setattr(fileformat, "write_deflated", spy)
    monkeypatch.setattr(spill, "DEFLATE_MIN_CPUS", 1)
    with memprof.capture(output=tmp_path / "run.memprof") as cap:
        for _ in range(60_000):
            torch.empty(8)
        time.sleep(0.6)  # a flush of the spill
        rec = recorder.current()
        assert rec is not None and rec.spill is not None
        with open(rec.spill.path, "rb") as f:
            kinds = [kind for kind, _at, _n in index_records(f, rec.spill.path)]
        for _ in range(3_000):  # the tail: still in the store when the capture stops
            torch.empty(8)
    assert b"Z" in kinds and used == [True]
    with zipfile.ZipFile(tmp_path / "run.memprof") as zf:
        assert zf.testzip() is None
    saved = memprof.load(tmp_path / "run.memprof")
    assert len(cap.raw) >= 252_000 and np.array_equal(saved.raw, cap.raw)

    used.clear()
    with memprof.capture(output=tmp_path / "ring.memprof", keep_last=1) as ring:
        for _ in range(3):
            for _ in range(20_000):
                torch.empty(8)
            memprof.step()
            time.sleep(0.6)
    assert used == [False] and np.array_equal(memprof.load(tmp_path / "ring.memprof").raw, ring.raw)

    monkeypatch.setattr(spill, "DEFLATE_MIN_CPUS", 10_000)
    with memprof.capture(output=tmp_path / "few.memprof") as few:
        for _ in range(60_000):
            torch.empty(8)
        time.sleep(0.6)
    assert used == [False, False] and np.array_equal(memprof.load(tmp_path / "few.memprof").raw, few.raw)
