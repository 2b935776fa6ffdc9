"""A sweep's measured processes compile side by side and time their steps one at a time
(`memprof.sweep.turns.StepTurn`), on real file locks between real processes."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

PROBE = ("import fcntl, sys; f = open(sys.argv[1], 'a')\n"
         "try:\n    fcntl.flock(f, (fcntl.LOCK_EX if sys.argv[2] == 'ex' else fcntl.LOCK_SH) | fcntl.LOCK_NB)\n"
         "except BlockingIOError:\n    sys.exit(3)\n")
CHILD = ("import sys; from pathlib import Path; from memprof.sweep.turns import StepTurn\n"
         "t = StepTurn(Path(sys.argv[1])); t.start(); print('compiling', flush=True)\n"
         "sys.stdin.readline(); t.before_marker(2); t.before_marker(1); t.before_marker(1)\n"
         "print('timing', flush=True); sys.stdin.readline()\n")


def _free(lock: Path, mode: str) -> bool:
    rc = subprocess.run([sys.executable, "-c", PROBE, str(lock), mode]).returncode
    assert rc in (0, 3)
    return rc == 0


def _child(lock: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    return p


def _say(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()


def test_compiles_run_together_and_steps_are_timed_alone(tmp_path: Path) -> None:
    lock = tmp_path / "steps.lock"
    a, b = _child(lock), _child(lock)
    assert a.stdout is not None and b.stdout is not None
    assert a.stdout.readline().strip() == "compiling" and b.stdout.readline().strip() == "compiling"  # together
    assert _free(lock, "sh") and not _free(lock, "ex")  # another may compile; none may time
    _say(a)  # a's first step ends: it waits for b's compile
    assert not _free(lock, "ex")
    _say(b)  # b's ends too: one of them times, then the other
    ready, _, _ = select.select([a.stdout, b.stdout], [], [], 60)
    assert len(ready) == 1  # one, not both
    first, second = (a, b) if ready[0] is a.stdout else (b, a)
    assert first.stdout is not None and first.stdout.readline().strip() == "timing"
    assert not _free(lock, "sh")  # no compile starts while a process times its steps
    _say(first)
    assert first.wait(timeout=60) == 0  # its exit lets the lock go
    assert second.stdout is not None and second.stdout.readline().strip() == "timing"
    _say(second)
    assert second.wait(timeout=60) == 0
    assert _free(lock, "ex")
