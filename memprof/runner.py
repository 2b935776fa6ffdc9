"""Run an unmodified Python script as `python SCRIPT ARGS` would, inside this process."""

from __future__ import annotations

import builtins
import signal
import sys
import threading
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from memprof.errors import MemprofError, one_line
from memprof.outputs import existing_file

_PY_SUFFIXES = {".py", ".pyw"}


def check_script(script: str) -> Path:
    """The script's path, or a one-line error if it is missing or not a Python file."""
    path = existing_file(script, f"script {script} does not exist",
                         f"script {script} is a directory, not a Python file")
    try:
        head = path.read_bytes()[:4096]
    except OSError as exc:
        raise MemprofError(f"cannot read script {script}: {exc.strerror or exc}") from None
    shebang = head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]
    if path.suffix not in _PY_SUFFIXES and not shebang:
        raise MemprofError(f"script {script} is not a Python file (expected a .py file)")
    if b"\0" in head:
        raise MemprofError(f"script {script} is not a Python file (it is binary)")
    if path.name == "torchrun" or b"from torch.distributed.run import main" in head:
        raise MemprofError(f"{script} is torchrun, the launcher: memprof traces the processes it starts, with "
                           "torchrun [its options] -m memprof trace SCRIPT [ARGS] -o run.memprof (a file per rank)")
    return path


@dataclass
class ScriptResult:
    exit_code: int
    status: str  # completed | exit | exception | oom | interrupted
    error: str | None = None  # one line: the exception, for exception/oom


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread so the capture is saved."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class SignalGuard:
    """Ctrl-C, SIGTERM and SIGHUP while a script runs under capture, then while memprof saves.

    While the script runs, each ends it (KeyboardInterrupt, or `Terminated` for SIGTERM/SIGHUP) so
    the capture is saved. From the moment the script has ended (`script_done`, called by
    `run_script` before anything else happens) no signal can interrupt memprof: one prints that the
    capture is being saved and is remembered (`received`), so stopping the capture and writing the
    file always finish. Install on the main thread only (elsewhere it does nothing)."""

    def __init__(self) -> None:
        self.running = False
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalGuard:
        if _main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self.running = True
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def script_done(self) -> None:
        """The script has ended: from now on signals wait for the save (the script's own handlers,
        if it installed any, are replaced)."""
        self.running = False
        if self._previous:
            for sig in _SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.running:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(signum)
        if not self.received:
            print("memprof: saving the capture, please wait", file=sys.stderr, flush=True)
        self.received.append(signum)


class FatalSignals:
    """SIGTERM and SIGHUP, where they would kill the process outright (their default action), end
    the block with `Terminated` instead, so the capture is saved; `deliver` then sends the signal
    again with its default action back. Main thread only; signals with handlers are left alone."""

    def __init__(self) -> None:
        self._installed: dict[int, Any] = {}
        self.received: int | None = None

    def __enter__(self) -> FatalSignals:
        if threading.current_thread() is threading.main_thread():
            for name in ("SIGTERM", "SIGHUP"):
                sig = getattr(signal, name, None)
                if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
                    self._installed[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
            raise Terminated(signum)

    def restore(self) -> None:
        for sig, handler in self._installed.items():
            signal.signal(sig, handler)
        self._installed.clear()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def deliver(self) -> None:
        if self.received is not None:
            signal.raise_signal(self.received)


def interrupted(exc: KeyboardInterrupt | Terminated) -> ScriptResult:
    """The result of a script ended by Ctrl-C, SIGTERM or SIGHUP (`SignalGuard`), said on stderr."""
    result = outcome(exc)
    what = "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else f"terminated ({result.error})"
    print(f"memprof: {what}; saving the capture", file=sys.stderr)
    return result


def outcome(exc: BaseException | None) -> ScriptResult:
    """How a run ended, from the exception that ended it (None: it ran to its end). Ctrl-C and
    SIGTERM/SIGHUP (`Terminated`) are "interrupted", with the shell's exit code for the signal."""
    if exc is None:
        return ScriptResult(0, "completed")
    if isinstance(exc, SystemExit):
        return ScriptResult(_exit_code(exc.code), "exit")
    if isinstance(exc, KeyboardInterrupt):
        return ScriptResult(130, "interrupted", "KeyboardInterrupt")
    if isinstance(exc, Terminated):
        return ScriptResult(128 + exc.signum, "interrupted", signal.Signals(exc.signum).name)
    return ScriptResult(1, "oom" if _is_oom(exc) else "exception", one_line(exc))


def _script_traceback(exc: BaseException, path: Path) -> TracebackType | None:
    """The exception's traceback from the script's first frame on (memprof's frames removed); None
    when no frame is the script's (a SyntaxError: Python then shows the offending line itself)."""
    tb = exc.__traceback__
    target = str(path)
    while tb is not None and tb.tb_frame.f_code.co_filename != target:
        tb = tb.tb_next
    return tb


def run_script(path: Path, args: list[str], stop: type[BaseException] | None = None,
               signals: SignalGuard | None = None) -> ScriptResult:
    """Execute `path` as __main__ with sys.argv = [path, *args]; never raises for script errors.

    `stop`: an exception type a hook raises to end the script early on purpose (status "stopped").
    `signals`: the guard the caller holds around the capture and its save (one is made otherwise)."""
    source = path.read_bytes()
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    saved_main = sys.modules.get("__main__")
    main = types.ModuleType("__main__")
    main.__dict__.update({"__file__": str(path), "__builtins__": builtins, "__cached__": None})
    sys.argv = [str(path), *args]
    script_dir = str(path.resolve().parent)
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    sys.modules["__main__"] = main
    own = signals is None
    guard = SignalGuard() if signals is None else signals
    if own:
        guard.__enter__()
    try:
        try:
            code = compile(source, str(path), "exec", dont_inherit=True)
            exec(code, main.__dict__)
        finally:
            guard.script_done()  # first: a signal from here on must not interrupt memprof
        return outcome(None)
    except SystemExit as exc:
        return outcome(exc)
    except (KeyboardInterrupt, Terminated) as exc:
        return interrupted(exc)
    except BaseException as exc:  # the script's own error: print it as Python would
        if stop is not None and isinstance(exc, stop):
            return ScriptResult(0, "stopped")
        traceback.print_exception(type(exc), exc, _script_traceback(exc, path), file=sys.stderr)
        return outcome(exc)
    finally:
        if own:
            guard.__exit__(None, None, None)
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _is_oom(exc: BaseException) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
