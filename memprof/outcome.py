"""How a run ended, from the exception that ended it: the script's (`memprof.runner`) or a capture's
block (`memprof.recorder`)."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from memprof.errors import one_line


@dataclass
class ScriptResult:
    exit_code: int  # as a shell reports it (128 + N for a run a signal ended)
    status: str  # completed | exit | exception | oom | interrupted | stopped
    error: str | None = None  # one line: the exception, for exception/oom; the signal's name
    signal: int | None = None  # the signal the program ends by (SIGINT for an uncaught KeyboardInterrupt)


def outcome(exc: BaseException | None) -> ScriptResult:
    """How a run ended, from the exception that ended it (None: it ran to its end)."""
    if exc is None:
        return ScriptResult(0, "completed")
    if isinstance(exc, SystemExit):  # (a message as its code: what Python prints, the run's error)
        message = None if exc.code is None or isinstance(exc.code, int) else (str(exc.code).splitlines() or [""])[0]
        return ScriptResult(_exit_code(exc.code), "exit", message)
    if isinstance(exc, KeyboardInterrupt):
        return ScriptResult(128 + signal.SIGINT, "interrupted", "KeyboardInterrupt", signal.SIGINT)
    return ScriptResult(1, "oom" if _is_oom(exc) else "exception", one_line(exc))


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1  # (Python prints a code that is no integer, and exits 1)


def _is_oom(exc: BaseException) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
