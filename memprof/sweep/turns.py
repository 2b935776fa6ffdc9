"""Measured budgets timed in turns: the processes of a sweep compile side by side but time their
steps one at a time, so that step times compare across budgets (`memprof sweep --jobs N`).

A process holds a shared lock on the sweep's step lock while it starts and compiles (its first
step), and an exclusive one from the end of its first step to its exit: compiles run together,
but never while a process times its steps, and no two processes time at once. (Predicting
processes take the device in turns their own way: `memprof.sweep.predict.DeviceTurn`.)
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO


class StepTurn:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self.timing = False

    def start(self) -> None:
        """Before the script runs: the shared hold (waits while a process times its steps)."""
        self._file = open(self.path, "a")  # noqa: SIM115 (held until the process exits)
        fcntl.flock(self._file, fcntl.LOCK_SH)

    def before_marker(self, step: int) -> None:
        """As step 1 ends (before its marker, so the wait is the compiling step's): the exclusive
        hold, to the process's exit, once every compile in flight has ended."""
        if step != 1 or self._file is None or self.timing:
            return
        fcntl.flock(self._file, fcntl.LOCK_EX)
        self.timing = True
