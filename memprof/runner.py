"""Running an unmodified script as `python SCRIPT ARGS` runs it, inside this process (`run_script`),
and under a capture (`traced`: what `memprof trace` and each measuring sweep process do).

The script gets what Python gives it: `sys.argv` as typed (`./s.py` stays `./s.py`), an absolute
`__file__` and code file name, a `SourceFileLoader` as `__loader__`, the script's real directory as
`sys.path[0]`, and the signal dispositions the shell left (memprof takes over only SIGTERM and SIGHUP
where their action is the default, at the OS level, so `signal.getsignal()` answers as under
Python). Once its code has run, Python's own exit sequence waits for its non-daemon threads
(`threading`'s exit functions, then each joined) before memprof stops the capture. An uncaught
exception goes to `sys.excepthook`; a KeyboardInterrupt, or a fatal signal, ends memprof's process
by that signal, once the capture is saved.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import gc
import importlib.machinery
import os
import shlex
import signal
import sys
import threading
import traceback
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from memprof.capture_info import Keep
from memprof.console import flush_std, say
from memprof.errors import MemprofError
from memprof.outcome import ScriptResult, outcome
from memprof.outputs import existing_file, shown

if TYPE_CHECKING:
    from memprof.capture import Capture

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


@dataclass(frozen=True)
class Ending:
    """How memprof's process ends once the capture is saved: with `code`, or by `signal` (after
    Python's exit functions, as Python ends on an uncaught KeyboardInterrupt; `at_once`: as a fatal
    signal that came while memprof saved would have ended the program, with none)."""

    code: int
    signal: int | None = None
    at_once: bool = False


def _absolute(given: str) -> str:
    """The script's path as Python makes `__file__` of it: joined to the working directory, not normalized."""
    return given if os.path.isabs(given) else os.path.join(os.getcwd(), given)


def _main_module(file: str) -> types.ModuleType:
    """`__main__` as Python makes it for a script."""
    main = types.ModuleType("__main__")
    names = vars(main)
    if "__annotations__" in getattr(sys.modules.get("__main__"), "__dict__", {}):
        names["__annotations__"] = {}  # (Python gives every __main__ one, up to 3.13)
    names.update({"__file__": file, "__builtins__": builtins, "__cached__": None,
                  "__loader__": importlib.machinery.SourceFileLoader("__main__", file)})
    return main


def _script_traceback(exc: BaseException, file: str) -> TracebackType | None:
    """The exception's traceback from the script's first frame on (memprof's frames removed); None
    when no frame is the script's (a SyntaxError: Python then shows the offending line itself)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != file:
        tb = tb.tb_next
    return tb


def _uncaught(exc: BaseException, file: str) -> None:
    """What Python does with an exception the script did not catch: `sys.excepthook` (the script's,
    where it set one), and where the hook itself fails, both tracebacks."""
    tb = _script_traceback(exc, file)
    exc = exc.with_traceback(tb)  # (Python's own hook prints the exception's traceback, not the one given)
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_error:
        with contextlib.suppress(Exception):
            print("Error in sys.excepthook:", file=sys.stderr)
            traceback.print_exception(hook_error)
            print("\nOriginal exception was:", file=sys.stderr)
            traceback.print_exception(type(exc), exc, tb)


def _python_exit() -> None:
    """Python's exit sequence up to the exit functions: `threading`'s own (an executor's workers are
    let go) and every non-daemon thread joined. Python runs it again at its exit, and then it is done."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()


def run_script(script: str | os.PathLike[str], args: list[str], stop: type[BaseException] | None = None,
               exiting: bool = False) -> ScriptResult:
    """Execute `script` (the path as given) as __main__ with sys.argv = [script, *args]; never raises for
    the script's errors. `stop`: an exception type a hook raises to end the script early on purpose
    (status "stopped"). `exiting`: the process ends with the script (memprof's command line): Python's
    exit sequence runs once its code has (`_python_exit`: its non-daemon threads are waited for)."""
    script = os.fspath(script)
    file = _absolute(script)
    source = Path(file).read_bytes()
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    saved_main = sys.modules.get("__main__")
    main = _main_module(file)
    sys.argv = [script, *args]
    script_dir = os.path.dirname(os.path.realpath(file))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    sys.modules["__main__"] = main
    result: ScriptResult | None = None
    try:
        try:
            code = compile(source, file, "exec", dont_inherit=True)
            exec(code, main.__dict__)
            result = outcome(None)
        except SystemExit as exc:
            if exc.code is not None and not isinstance(exc.code, int):
                with contextlib.suppress(Exception):  # as Python prints a code that is no integer
                    print(exc.code, file=sys.stderr)
            result = outcome(exc)
        except BaseException as exc:  # the script's own error: as Python would show it
            if stop is not None and isinstance(exc, stop):
                return ScriptResult(0, "stopped")
            _uncaught(exc, file)
            result = outcome(exc)
        if exiting:
            try:
                _python_exit()
            except KeyboardInterrupt as exc:  # Ctrl-C while Python waited for the script's threads
                _uncaught(exc, file)
                result = outcome(exc)
        return result
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


_SAVE_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class SaveGuard:
    """From the script's end until memprof has saved and said so, no signal interrupts memprof: each
    that would end the process prints that the capture is being saved and is remembered (`received`);
    the process then ends by it. A signal the shell set to be ignored stays ignored. Main thread only
    (elsewhere it does nothing)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SaveGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in _SAVE_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            say("memprof: saving the capture, please wait")
        self.received.append(signum)


@dataclass(frozen=True)
class TraceOptions:
    budget: float | None = None
    remat: str = "off"
    max_events: int | None = None
    scopes: str = "ops"
    kernels: bool = False
    knapsack_evaluator: bool = False  # the sweep's measurements also run KnapsackEvaluator
    force: bool = False  # --force: replace the outputs, and the spill a killed run left beside them
    keep: Keep = field(default_factory=Keep)  # --steps, --keep-last, --exit-after
    taken: tuple[str, ...] = ()  # memprof's options that came after SCRIPT (the summary names them)
    before_marker: Callable[[int], None] | None = None  # (the sweep: the machine taken in turns after step 1)


def _remat(mode: str) -> contextlib.AbstractContextManager[None]:
    if mode == "off":
        return contextlib.nullcontext()
    from memprof.remat import enable

    return enable(mode)


@dataclass
class Traced:
    """What `traced` did: the capture (None in a forked child of the script, which saves nothing) and
    how memprof's process is to end."""

    capture: Capture | None
    result: ScriptResult
    ending: Ending


EXPORTS = {"chrome": ("--chrome", "Chrome/Perfetto trace", "open in ui.perfetto.dev"),
           "html": ("--html", "HTML report", "open it in a browser; it needs no network")}


def report(cap: Capture, exports: Mapping[str, Path], save_error: str | None, launch: Path, force: bool,
           summary: str | None = None) -> None:
    """The summary first (`summary`: its text, if made already), then where each file went (or why
    not): the capture and the `exports` (format -> path: "chrome", "html"). Of a distributed run's
    ranks only rank 0 prints it; the others print only what went wrong."""
    from memprof.errors import MemprofError
    from memprof.reporters import render, write

    quiet = cap.info.rank not in (None, 0)
    if not quiet:
        say((summary if summary is not None else render("text", cap)).rstrip("\n"))
    for fmt, path in exports.items():
        _option, what, hint = EXPORTS[fmt]
        try:
            written = _write_new(path, functools.partial(write, fmt, cap), force)
            if not quiet:
                say(f"memprof: {what} written to {shown(written, launch)} ({hint})")
        except OSError as exc:
            say(f"memprof: error: the {what} could not be written to {path}: {exc.strerror or exc}")
        except MemprofError as exc:
            say(f"memprof: error: no {what}: {exc}")
    if save_error is None and not quiet and cap.saved_to is not None:
        from memprof.ranks import run_path

        saved = shown(cap.saved_to, launch)
        also = f"; every rank's: memprof report {shown(run_path(cap.saved_to), launch)}" if cap.info.rank is not None \
            else ""
        say(f"memprof: capture saved to {saved} (memprof report {saved}{also})")
    elif save_error is not None:
        say(f"memprof: error: {save_error}")


def _write_new(path: Path, write: Callable[..., Path], force: bool) -> Path:
    """`write(target, replace)` at `path`; without `force` a file that appeared there is kept (`free_name`)."""
    from memprof.outputs import free_name

    target = path
    while True:
        try:
            return write(target, force)
        except FileExistsError:
            target = free_name(path)
            say(f"memprof: warning: {path} appeared while the capture ran (memprof did not write it) and is not "
                f"replaced: writing {target} instead")


def traced(script: str, script_args: list[str], out: Path, exports: Mapping[str, Path], opts: TraceOptions,
           launch: Path, exiting: bool = False, finished: Callable[[Capture], None] | None = None) -> Traced:
    """Run the script under capture as `memprof trace` does: saved whatever happens, the summary
    printed. `exiting`: memprof's process ends with the script (`run_script`); `finished(capture)`
    runs once the capture is saved, also when a fatal signal is about to end the process."""
    from memprof.analysis.window import never_opened
    from memprof.errors import SaveError
    from memprof.reporters import render
    from memprof.session import session
    from memprof.torch_hooks.budget import budget_set, current_budget

    pid = os.getpid()
    budget = budget_set(opts.budget)
    meta = {"command": shlex.join(["python", script, *script_args]), "argv": [script, *script_args],
            "script": str(Path(script).resolve()), "remat": opts.remat,
            "budget": opts.budget if opts.budget is not None else current_budget()}
    if opts.taken:
        meta["options_after_script"] = list(opts.taken)

    def on_fatal(cap: Capture, signum: int) -> None:
        cap.meta.update(status="interrupted", exit_code=128 + signum, error=signal.Signals(signum).name)
        report(cap, exports, None, launch, opts.force)
        if finished is not None:
            finished(cap)

    cap: Capture | None = None
    result: ScriptResult | None = None
    save_error: str | None = None
    guard = SaveGuard()
    summary: list[str] = []  # made beside the save, reading the events as it writes them

    def summarize(cap: Capture) -> None:
        if cap.info.rank in (None, 0) and os.getpid() == pid:
            summary.append(render("text", cap))

    try:
        with budget, _remat(opts.remat), session(
                max_events=opts.max_events, scopes=opts.scopes, kernels=opts.kernels,
                meta=meta, output=out, knapsack_evaluator=opts.knapsack_evaluator, replace_spill=opts.force,
                keep=opts.keep, overwrite=opts.force, on_fatal=on_fatal, before_marker=opts.before_marker,
                before_save=record_probes, beside_save=summarize) as cap:
            try:
                result = run_script(script, script_args, exiting=exiting)
            except BaseException:
                cap.meta.update(status="memprof-error", exit_code=None)  # memprof's own failure: still saved
                raise
            if os.getpid() == pid:
                guard.__enter__()  # the script has ended: from here on signals wait for the save
                cap.meta.update(status=result.status, exit_code=result.exit_code, error=result.error)
                gc.collect()  # (as Python's exit would: what only cycles held, named as the collector's)
    except SaveError as exc:
        save_error = str(exc)
    except BaseException:
        if cap is not None and cap.saved_to is not None:
            say(f"memprof: partial capture saved to {shown(cap.saved_to, launch)}")
        guard.__exit__()
        raise
    assert result is not None
    if os.getpid() != pid:  # a forked child of the script ends as the script's code says; the parent saves
        return Traced(None, result, Ending(result.exit_code))
    assert cap is not None
    try:
        report(cap, exports, save_error, launch, opts.force, summary[0] if summary else None)
        if finished is not None:
            finished(cap)
    finally:
        guard.__exit__()
        flush_std()
    if guard.received:  # a signal that came while saving ends the process as it would have ended it
        return Traced(cap, result, Ending(128 + guard.received[-1], guard.received[-1], at_once=True))
    empty = never_opened(cap.info)
    if empty is not None and result.exit_code == 0:
        say(f"memprof: error: {empty}")
        return Traced(cap, result, Ending(1))
    return Traced(cap, result, Ending(result.exit_code, result.signal))


def record_probes(cap: Capture) -> None:
    """The compiled graphs' fallback calls' scratch, probed once the capture stopped (torch loaded, no
    capture running) and saved with it: the summary's estimate and a later `memprof report`'s are one
    figure, the report running no kernel. Not after an exception or an OOM (the probes allocate on the
    device the script ran out of); a probe that crashes the process leaves the spill (`memprof report OUT`)."""
    if cap.plans and cap.meta.get("status") in ("completed", "exit"):
        from memprof.sweep.probe import probe_plans

        cap.meta["scratch_probes"] = probe_plans(cap.plans)
        cap.refresh_info()


def end_process(ending: Ending) -> None:
    """End memprof's process as `ending` says (memprof's command line: its process is the script's)."""
    flush_std()
    if ending.signal is None:
        sys.exit(ending.code)
    from memprof._native import native

    if ending.at_once:
        native().die_by_signal(ending.signal)
    _END["signal"] = ending.signal  # after the exit functions (`at_exit_end`), as Python does
    sys.exit(ending.code)


_END: dict[str, int] = {}


def at_exit_end() -> None:
    """The exit function registered first, so it runs last: the process ends by the signal `end_process`
    left, as Python ends one that a KeyboardInterrupt ended."""
    sig = _END.pop("signal", None)
    if sig is not None:
        flush_std()
        from memprof._native import native

        native().die_by_signal(sig)
