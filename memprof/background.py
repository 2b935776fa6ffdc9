"""A capture's own thread while it records to a file: the spill, and the fatal signals."""

from __future__ import annotations

import _thread
import signal
from collections.abc import Callable

from memprof._native import native
from memprof.console import say
from memprof.errors import one_line

# the spill is appended to at least this often (a kill loses at most about this much), and sooner when
# the native store holds more than 8 chunks (it wakes this thread)
INTERVAL_S = 0.5
# signals whose default action kills the process: caught (at the OS level only) to save the capture first
FATAL_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


class Background:
    """The capture's own thread, while it records to an output: every `INTERVAL_S` it appends what was
    recorded to the spill (`flush`), and it takes the fatal signals (`FATAL_SIGNALS`, where their action
    is the default): one ends the capture at once, holds the main thread where the signal found it,
    saves (`save(signum)`: the capture, and what to say of it) and lets the signal kill the process.
    Started with `_thread`, not `threading`: it is no thread of the program's (`threading.enumerate()`
    shows the script's threads only, and a script that joins them all does not wait for memprof's)."""

    def __init__(self, flush: Callable[[], None], save: Callable[[int], None], hold_main: bool) -> None:
        """`hold_main`: the capture runs on the main thread, which a fatal signal stops where it is."""
        self.flush, self.save = flush, save
        C = native()
        self.signals = list(C.take_fatal_signals(list(FATAL_SIGNALS), hold_main))
        self.hold_main = hold_main
        self._done = _thread.allocate_lock()
        self._done.acquire()
        _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        C = native()
        try:
            while (signum := int(C.wait_fatal_signal(int(INTERVAL_S * 1000)))) >= 0:
                if signum > 0:
                    self._fatal(signum)  # does not return
                self.flush()
        finally:
            self._done.release()

    def _fatal(self, signum: int) -> None:
        C = native()
        C.freeze()
        if self.hold_main:
            C.hold_main_thread()
        name = signal.Signals(signum).name
        try:
            say(f"memprof: terminated ({name}); saving the capture")
            self.save(signum)
        except BaseException as exc:  # the signal still ends the process: say why nothing was saved
            say(f"memprof: error: the capture could not be saved before {name} ended the process "
                f"({one_line(exc)}); its spill holds what was recorded")
        finally:
            C.die_by_signal(signum)

    def stop(self) -> None:
        """Give the signals back and end the thread: a fatal signal that came before is still handled
        (the process then dies by it, the capture saved)."""
        native().give_back_fatal_signals()
        self._done.acquire()
        self._done.release()
