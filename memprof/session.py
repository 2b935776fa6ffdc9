"""`memprof.capture()`, `memprof.step()` and the never-lose-a-capture policy around a recorder
(`memprof.recorder`).

The capture yielded is filled once, when the recorder stops (`Capture.set_recorded`). With `output`,
it is written there however the block ends: normally, by an exception (an OOM included), `sys.exit`
or Ctrl-C; and a SIGTERM or SIGHUP that would kill the process (their default action) kills it still,
by that signal, once the capture is saved: the capture's thread saves it while the program stays
where the signal found it (`memprof.background`). A forked child's copy of a capture records, saves
and prints nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from memprof import spill
from memprof._events import huge_pages
from memprof.background import Background
from memprof.capture import Capture
from memprof.capture_info import Keep
from memprof.console import say
from memprof.errors import MemprofError, SaveError, one_line
from memprof.outcome import outcome
from memprof.outputs import free_name, resolve
from memprof.recorder import DEFAULT_MAX_EVENTS, NO_BOUND, SCOPE_BITS, Recorder, activate, current, stop_active


def _save(cap: Capture, path: Path, rec: Recorder, overwrite: bool) -> None:
    """Write the capture to `path`; a file that appeared there while it ran (the script wrote it) is not
    replaced unless `overwrite`: the capture goes to the first free `NAME.N.memprof` beside it instead."""
    target = path
    try:
        while True:
            try:
                cap.saved_to = cap.save(target, overwrite=overwrite)
                break
            except FileExistsError:
                target = free_name(path)
        if target != path:
            say(f"memprof: warning: {path} appeared while the capture ran (memprof did not write it) and is not "
                f"replaced: the capture is saved to {target} instead (memprof trace --force, or "
                "capture(overwrite=True), replaces it)")
    except OSError as exc:
        if rec.spill is not None and rec.spill.failed:  # (a full disk) a partial spill is no copy: nothing stays
            rec.remove_spill()
        kept = spill.spill_path(path)
        also = (f" (its spill {kept} holds what was recorded: memprof report {path} recovers it)"
                if kept.exists() else "")
        raise SaveError(f"the capture could not be written to {target}: {exc.strerror or exc}{also}") from None


@contextlib.contextmanager
def session(*, max_events: int | None = None, scopes: str = "ops", kernels: bool = False, plans: bool = True,
            meta: dict[str, Any] | None = None, output: str | os.PathLike[str] | None = None,
            knapsack_evaluator: bool = False, replace_spill: bool = False, keep: Keep | None = None,
            overwrite: bool = False, on_fatal: Callable[[Capture, int], None] | None = None,
            before_marker: Callable[[int], None] | None = None,
            before_save: Callable[[Capture], None] | None = None,
            beside_save: Callable[[Capture], None] | None = None) -> Iterator[Capture]:
    """`capture()` with memprof's own options (`knapsack_evaluator`: the sweep's measurements;
    `replace_spill`: `memprof trace --force` replaces the spill a killed run left; `keep`: which
    steps are stored, and `Keep.exit_after`; `on_fatal(capture, signum)`: what to say once a fatal
    signal's capture is saved, before the signal ends the process; `before_marker(step)`: called as
    each step ends, before its marker is recorded; `before_save(capture)`: called once the capture
    stopped, before it is saved, unless a fatal signal ends the process: what it adds to the
    capture's metadata is saved with it; an error in it is a note, never a lost capture;
    `beside_save(capture)`: run on a thread of its own while the capture is saved, which reads the
    events at the same time (the summary `memprof trace` prints: on two cores the two take the time
    of the longer one); it must not change the capture, and what it raises is dropped)."""
    if scopes not in SCOPE_BITS:
        raise MemprofError(f"scopes must be one of {sorted(SCOPE_BITS)}, got {scopes!r}")
    if max_events is not None and (not isinstance(max_events, int) or max_events <= 0):
        raise MemprofError(f"max_events must be a positive number of events, got {max_events!r}")
    out = resolve(output) if output is not None else None  # a chdir in the block must not move it
    if out is not None and out.exists() and not overwrite:
        raise MemprofError(f"{out} already exists: pass overwrite=True to replace it, or give another output")
    left = spill.spill_path(out) if out is not None else None
    spill_fd = None
    if left is not None:  # the only copy of a killed run's capture is never replaced silently
        try:
            spill_fd = spill.claim(left, replace_spill)
        except OSError as exc:
            say(f"memprof: warning: no spill at {left} ({exc.strerror or exc}): the capture is kept in memory "
                "only (a kill would lose it)")
    if max_events is None:  # streamed to a spill: nothing dropped, whatever the run's length
        max_events = NO_BOUND if spill_fd is not None else DEFAULT_MAX_EVENTS
    cap = Capture(meta=dict(meta or {}))
    rec = Recorder(cap, max_events, scopes, kernels, plans, knapsack_evaluator, keep)
    rec.before_marker = before_marker
    try:
        activate(rec)
    except BaseException:
        if spill_fd is not None:
            os.close(spill_fd)
            rec.remove_spill(left)
        raise
    if spill_fd is not None and left is not None:
        rec.start_spill(spill_fd, left, cap.meta)
    if out is not None:
        target = out

        def save() -> None:
            _save(cap, target, rec, overwrite)

        def save_dying(signum: int) -> None:  # on the capture's thread: the process then dies by `signum`
            rec.stop(dying=True)
            cap.note_outcome("interrupted", 128 + signum, signal.Signals(signum).name)
            save()
            rec.remove_spill()
            if on_fatal is not None:
                on_fatal(cap, signum)

        rec.background = Background(lambda: rec.spill.flush() if rec.spill is not None else None, save_dying,
                                    hold_main=threading.current_thread() is threading.main_thread())
    ended: BaseException | None = None
    try:
        yield cap
    except BaseException as exc:
        ended = exc
        raise
    finally:
        if os.getpid() == rec.pid:  # (a forked child's copy does nothing: the parent saves)
            _finish(rec, ended, out, overwrite, before_save, beside_save)


def _finish(rec: Recorder, ended: BaseException | None, out: Path | None, overwrite: bool,
            before_save: Callable[[Capture], None] | None = None,
            beside_save: Callable[[Capture], None] | None = None) -> None:
    if current() is rec:
        stop_active()
    cap = rec.cap
    result = outcome(ended)
    cap.note_outcome(result.status, result.exit_code, result.error)
    if before_save is not None and not cap.recording:
        try:
            before_save(cap)
        except Exception as exc:  # (never a lost capture over what it adds)
            cap.meta.setdefault("notes", []).append(f"{getattr(before_save, '__name__', 'before_save')} failed "
                                                    f"({one_line(exc)})")
    if out is not None and not cap.recording:
        pages = huge_pages(False)  # (the save's and the summary's arrays: memprof's own)
        beside = _beside(beside_save, cap)
        try:
            _save(cap, out, rec, overwrite)
        except SaveError as exc:
            if ended is None:
                raise
            say(f"memprof: error: {exc}")  # the block's own exception goes on
        else:
            rec.remove_spill()  # the capture is on disk: its spill has done its job
        finally:
            if beside is not None:
                beside.join()
            huge_pages(pages)


def _beside(fn: Callable[[Capture], None] | None, cap: Capture) -> threading.Thread | None:
    """`fn(cap)` started on a thread of its own (`session`'s `beside_save`)."""
    if fn is None:
        return None

    def run() -> None:
        with contextlib.suppress(Exception):  # (whoever wanted its result does the work again)
            fn(cap)

    thread = threading.Thread(target=run, name="memprof-beside-save", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def capture(*, max_events: int | None = None, scopes: str = "ops", kernels: bool = False, plans: bool = True,
            meta: dict[str, Any] | None = None, output: str | os.PathLike[str] | None = None,
            steps: tuple[int, int] | None = None, keep_last: int | None = None,
            overwrite: bool = False) -> Iterator[Capture]:
    """Capture every allocation and free (CPU on every thread; CUDA on this thread and its autograd
    threads, and through the allocator tracker on others).

    `scopes` picks the RecordFunction scopes recorded: "ops" (every autograd node, user region and
    compiled-graph call, and every aten op in which an allocation or free is recorded: an op that
    makes neither leaves no scope, except inside a graph's first call; inside its later calls, only
    the calls that return fresh tensors, all the buffer join needs), "graphs" (compiled-graph calls
    and user record_function regions) or "none". `kernels` (with "ops") makes Inductor open a scope
    for each kernel launch too, and records every op inside every compiled-graph call: a Chrome
    trace then shows every launch, at a host-bound step's cost; without it, each buffer of a
    compiled graph still names the kernel that writes it (from the wrapper code). `plans` records what
    torch.compile decides for graphs compiled inside the block (partitions, wrapper code;
    AOTAutograd's and Inductor's FX graph caches hold memprof's own entries meanwhile) for
    `Capture.attribution`. `max_events` bounds the events stored (the rest are counted as dropped and
    the capture says it is incomplete); by default there is no bound where the capture streams to
    `output` (its spill holds the events; memory holds what half a second records), and 16.7 M events
    (940 MB) where it is held in memory. The yielded `Capture` is filled when the block exits, also when it exits
    by an exception. With `output`, it is also
    saved there (atomically) however the block exits: an exception, an OOM, `sys.exit` or Ctrl-C; a
    SIGTERM or SIGHUP that would kill the process still kills it, by that signal, once the capture is
    saved. An existing `output` is refused unless `overwrite` (a file that appears there while the
    block runs is kept too: the capture goes to `NAME.N.memprof` beside it, said on stderr). A file
    that cannot be written raises `SaveError` (after a normal exit) or is one stderr line (when the
    block's own exception is on its way out).

    `steps=(A, B)` stores only steps A to B (step k ends at the k-th optimizer step or
    `memprof.step()`; step 1 starts with the block); `keep_last=N` only the last N complete steps
    and the one in progress. Either way the blocks live where the stored steps begin are kept
    exactly (their own allocation events), so attribution there sums as in a full capture; compile
    plans are recorded for every graph compiled in the block.
    """
    with session(max_events=max_events, scopes=scopes, kernels=kernels, plans=plans, meta=meta,
                 output=output, keep=Keep.of(steps, keep_last), overwrite=overwrite) as cap:
        yield cap


def step() -> int:
    """Mark the end of a training step in the active capture; returns the step number (0 if none).

    Once a script calls `memprof.step()`, optimizer steps no longer add markers of their own.
    """
    rec = current()
    if rec is None:
        return 0
    rec.explicit_steps = True
    return rec.mark_step(source="memprof.step")
