"""OOM forensics on a capture built event by event: each figure of the section, to the byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import memprof
from memprof._events import EVENT_DTYPE, Kind
from memprof.analysis.oom import format_oom, oom_reports
from memprof.reporters import render

MiB = 1 << 20


def _capture(alloc_conf: str | None = None) -> memprof.Capture:
    rows = [  # (kind, bytes, ptr, scope, aux)
        (Kind.SEGMENT_ALLOC, 12 * MiB, 0x1000, 0, -1),
        (Kind.ALLOC, 2 * MiB, 0x1000, 1, 2 * MiB),      # step 1
        (Kind.STEP, 1, 0, 0, -1),
        (Kind.ALLOC, 3 * MiB, 0x4000, 1, 3 * MiB),      # step 2, still live at the OOM
        (Kind.ALLOC, 1 * MiB, 0x8000, 1, 1 * MiB),
        (Kind.FREE, -1 * MiB, 0x8000, 1, -1),
        (Kind.OOM, 40 * MiB, 0, 2, 30 * MiB),           # requested 40 MiB with 30 MiB free
    ]
    raw = np.zeros(len(rows), dtype=EVENT_DTYPE)
    for i, (kind, nbytes, ptr, scope, aux) in enumerate(rows):
        raw[i]["t_ns"] = 1000 + 10 * i
        raw[i]["kind"], raw[i]["bytes"], raw[i]["ptr"], raw[i]["scope"], raw[i]["aux"] = kind, nbytes, ptr, scope, aux
        raw[i]["device_type"], raw[i]["device_index"] = (1, 0) if kind != Kind.STEP else (-1, -1)
        raw[i]["stream"] = 7 if kind == Kind.OOM else 0
    meta = {"t_start_ns": 1000, "t_stop_ns": 2000, "baselines": {"cuda:0": {"allocated": 1 * MiB, "reserved": 2 * MiB}},
            "cuda_tracker": "attached", "device_total": {"cuda:0": 100 * MiB}, "alloc_conf": alloc_conf,
            "status": "oom", "budget": 0.1, "argv": ["train.py", "--big"]}
    return memprof.Capture(raw=raw, strings=["", "aten::empty", "aten::mm"], meta=meta)


def test_every_figure_of_the_oom_section() -> None:
    cap = _capture()
    (r,) = oom_reports(cap)
    assert (r.device, r.requested_bytes, r.free_bytes, r.stream, r.scope, r.step) == (
        "cuda:0", 40 * MiB, 30 * MiB, 7, "aten::mm", 2)
    assert r.allocated_bytes == 1 * MiB + 2 * MiB + 3 * MiB  # the baseline and what is live
    assert sum(x.bytes for x in r.by_category) == sum(x.bytes for x in r.by_node) == r.allocated_bytes
    assert r.by_age == [("allocated in this step", 3 * MiB), ("allocated in earlier steps", 2 * MiB),
                        ("allocated before the capture", 1 * MiB)]
    assert r.reserved_bytes == 14 * MiB and r.fragmentation_bytes == 8 * MiB
    assert r.outside_bytes == 100 * MiB - 30 * MiB - 14 * MiB
    assert r.last_steps == [(1, 3 * MiB)]
    assert r.config["activation_memory_budget"] == 0.1
    assert any("10.5 MB more than the 31.5 MB" in n for n in r.next_steps), r.next_steps
    assert any("outside PyTorch" in n for n in r.next_steps)  # 56 MiB of 100
    assert any("expandable_segments:True" in n for n in r.next_steps)  # 8 MiB unallocated: > 5% of the device
    text = "\n".join(format_oom(r))
    assert "OUT OF MEMORY on cuda:0" in text and "in step 2" in text and "allocated by PyTorch 6.3 MB" in text
    assert "OUT OF MEMORY on cuda:0" in render("text", cap)


def test_expandable_segments_already_set_is_not_advised_again() -> None:
    (r,) = oom_reports(_capture("expandable_segments:True"))
    assert not any("expandable_segments" in n for n in r.next_steps)


def test_the_next_step_names_a_sweep_that_fits_the_device() -> None:
    """With activations live and plans recorded: the sweep covers 0 to 1 and the budget that ran
    out, one process per budget, and the section says what fits."""
    import dataclasses

    from memprof.analysis.attribution import AttributionRow
    from memprof.analysis.oom import _next_steps, _sweep_command

    cap = memprof.load(Path(__file__).parents[1] / "fixtures" / "tiny_compiled.memprof")
    cap.meta["argv"], cap.meta["budget"] = ["train.py", "--big"], 0.07
    (r,) = oom_reports(_capture())
    assert r.fit_bytes == 30 * MiB + 3 * MiB  # free, and what step 2 had allocated
    assert r.sweep_command is None  # no plans in that capture
    r = dataclasses.replace(r, by_category=[AttributionRow("saved_activation", 4 * MiB, 1, 0.5, "saved_activation"),
                                            *r.by_category])
    command = _sweep_command(r, cap)
    assert command == ["memprof", "sweep", "train.py", "--big", "--budgets",
                       "0,0.05,0.07,0.1,0.15,0.2,0.25,0.3,0.5,1", "--predict", "--jobs", "10"]
    text = _next_steps(dataclasses.replace(r, sweep_command=command), cap)[-1]
    assert "under 34.6 MB" in text and "--jobs 10" in text and "(4.2 MB saved for the backward" in text, text


def test_predicting_processes_take_the_device_in_turns(tmp_path: Path) -> None:
    """DeviceTurn: from its first call to its release (or its process's exit), no other process
    gets the lock."""
    import subprocess
    import sys

    lock = tmp_path / "device.lock"
    probe = ("import fcntl, sys; f = open(sys.argv[1], 'a')\n"
             "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")
    holder = ("import sys; from pathlib import Path; from memprof.sweep.predict import DeviceTurn\n"
              "t = DeviceTurn(Path(sys.argv[1])); t(); t(); DeviceTurn(None)(); print('held', flush=True)\n"
              "sys.stdin.readline(); t.release(); t.release(); print('released', flush=True)\n"
              "sys.stdin.readline(); t(); print('held', flush=True); sys.stdin.readline()\n")

    def other_gets_it() -> bool:
        rc = subprocess.run([sys.executable, "-c", probe, str(lock)]).returncode
        assert rc in (0, 3)
        return rc == 0

    p = subprocess.Popen([sys.executable, "-c", holder, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline().strip() == "held"
    assert not other_gets_it()
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "released"
    assert other_gets_it()
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "held"  # taken again
    assert not other_gets_it()
    p.stdin.close()  # the process ends holding it: the lock goes with it
    assert p.wait(timeout=60) == 0
    assert other_gets_it()
