"""The spill: what a running capture has recorded, appended every half second (and whenever the
native store holds more than 8 chunks, 14 MB) to a file beside its output (`<output>.spill`), so
that `kill -9`, `os._exit` or a machine crash loses at most the last interval. A capture that is
saved normally removes its spill; `memprof.load(OUTPUT)` recovers one that was left behind.

The file: `MAGIC`, then records of one type byte, an 8-byte little-endian length and the payload:
`M` the capture's metadata at its start (JSON), `E` events (raw `EVENT_DTYPE` records, in order),
`S` strings (JSON list: the next ids), `T` the thread table (JSON), `P` compile plans, graphs
(with their wrapper source) and known tensors recorded since the last `P` (JSON), `C` where the
blocks carried into a step window or a ring were allocated (JSON, `CarriedBlock`s; the last one
holds), `Z` the events deflated so far, as the capture file will hold them (`memprof.deflate`: the
save copies them; a spill read back after a kill ignores them). A record the kill cut short is
ignored. The file is fsynced at least every half second: a
machine crash keeps what was written before the last interval.

A spill is locked (`flock`) by the process that writes it, for as long as that process lives: a
second run with the same output is refused while the first one runs, even with --force, and a
spill left by a run that was killed is told apart from one still being written.

A capture that keeps a ring of the last steps (`keep_last`) keeps its spill bounded too: once the
file holds more than twice the ring, it is written anew (beside it, then renamed over it) from the
ring's start: the blocks live there (their carried events), then the ring's own events.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from memprof._events import EVENT_DTYPE, CarriedBlock
from memprof._native import thread_table
from memprof.console import say
from memprof.deflate import StreamDeflater
from memprof.errors import CaptureFileError, MemprofError, one_line
from memprof.plans import KnownTensor, KnownTensors
from memprof.spill_read import HEAD, MAGIC, TENSORS_RECORD, SpilledEvents, index_records, spilled_tensors, try_lock

RECORD_EVENTS = 1 << 15  # events per record (1.8 MB)
# the spill deflates its events as it writes them (the save then copies them) only where the process
# may run on this many cores: on fewer, the deflate thread competes with the script (on 2 cores
# `memprof trace` ran 4% longer with it; docs/benchmarks.md, session 19). The variable sets it either
# way (1 or 0): core counts do not show a container's CPU quota
DEFLATE_MIN_CPUS = 4
DEFLATE_ENV = "MEMPROF_DEFLATE_WHILE_RUNNING"
SYNC_EVERY_S = 0.5  # a write fsyncs the file once this long has passed since the last fsync


class Recorded(NamedTuple):
    """What the compile hooks recorded so far; `pruned` counts the times known tensors were pruned."""

    plans: list[Any]
    graphs: list[Any]
    tensors: KnownTensors
    pruned: int


class _Moved(Exception):
    """The ring moved while the spill was written anew."""


def spill_path(output: Path) -> Path:
    return output.with_name(output.name + ".spill")


def _writer_of(path: Path) -> str:
    """Who writes a live spill, from its metadata record: "pid N on HOST" (or "another process")."""
    try:
        with open(path, "rb") as f:
            records = index_records(f, path)
            kind, at, length = records[0] if records else (b"", 0, 0)
            f.seek(at)
            meta = json.loads(f.read(length)) if kind == b"M" else {}
        return f"pid {int(meta['pid'])} on {meta.get('hostname') or 'this host'}"
    except (OSError, ValueError, KeyError, TypeError, CaptureFileError):
        return "another process"


def _clear_left(path: Path, replace: bool) -> None:
    """A spill is already at `path`: refused in one line while its run goes on, or (it was left by a
    run that was cut short) unless `replace`; else removed."""
    output = path.with_name(path.name.removesuffix(".spill"))
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        if not try_lock(fd):
            raise MemprofError(f"{output} is being recorded now by another memprof ({_writer_of(path)}, which "
                               f"holds {path.name}): give this run another output")
        if not replace:
            raise MemprofError(f"{path} is the spill of an earlier run that was cut short: memprof report {output} "
                               "(or memprof.load) recovers it; move or delete it (memprof trace: --force) to "
                               "record again")
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # (still the file locked here)
                path.unlink()
    finally:
        os.close(fd)


def claim(path: Path, replace: bool = False) -> int:
    """Create the spill at `path`, locked by this process until it ends, and return its descriptor. A
    spill already there is refused or replaced (`_clear_left`). The file is made, locked and given a
    first metadata record (who writes it) under a name of its own, then linked into place, so a
    spill that can be seen is always locked by its writer and names it (two runs starting at once
    cannot both think the other's was left behind)."""
    who = json.dumps({"pid": os.getpid(), "hostname": platform.node()}).encode()
    head = MAGIC + HEAD.pack(b"M", len(who)) + who
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        try_lock(fd)
        os.write(fd, head)
        while True:
            try:
                os.link(tmp, path)
                return fd
            except FileExistsError:
                _clear_left(path, replace)
            except OSError:  # a file system without hard links: create in place (the lock follows at once)
                new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                os.close(fd)
                fd = new
                try_lock(fd)
                os.write(fd, head)
                return fd
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def deflates_while_running() -> bool:
    """Whether a spill made now deflates its events as it writes them (`DEFLATE_ENV`, else the cores)."""
    said = os.environ.get(DEFLATE_ENV, "").strip()
    if said in ("0", "1"):
        return said == "1"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cpus >= DEFLATE_MIN_CPUS


class SpillWriter:
    """Copies what the native session records to the spill (`flush`, called by the capture's thread
    every half second and when the native store fills: `memprof.background`).

    A spill that cannot be written (a full disk, a read-only directory) is one stderr line and the
    capture goes on in memory, for at most `bound_on_failure` more events (what the spill holds stays
    there); the job itself never fails over it."""

    def __init__(self, fd: int, path: Path, native: Any, meta: dict[str, Any],
                 recorded: Callable[[], Recorded], *, ring: bool, bound_on_failure: int) -> None:
        self.path, self.native, self.recorded, self.ring = path, native, recorded, ring
        self.bound_on_failure = bound_on_failure
        self.events = self.strings = self.plans = self.graphs = self.tensors = 0
        self.file_start = 0  # the first event (store index) the file holds after its carried ones
        self.pruned = 0  # known tensors were pruned this often when last written
        self.carried_written = False  # the window's carried blocks' context is on file
        self._compiled: tuple[tuple[int, ...], bytes] = ((), b"")
        self.threads: list[dict[str, object]] = []
        self.failed = False
        # the events on file, deflated as they are written (not for a ring, whose file is written anew)
        self.deflater = None if ring or not deflates_while_running() else StreamDeflater()
        self._synced = time.monotonic()
        self._lock = threading.Lock()
        self._meta = json.dumps(meta, default=str).encode()
        self._fd = fd  # (`claim` wrote the magic and who writes the spill: the capture's metadata follows)
        self._record(b"M", self._meta)

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def _record(self, kind: bytes, payload: bytes | memoryview) -> None:
        self._write(HEAD.pack(kind, len(payload)))
        self._write(payload)  # (not joined to the head: no copy of a large payload)

    def flush(self) -> None:
        """Append what was recorded since the last flush."""
        with self._lock:
            if self.failed:
                return
            try:
                self._flush()
            except OSError as exc:
                more = self._keep_in_memory()
                say(f"memprof: warning: the spill {self.path} could not be written ({exc.strerror or exc}) after "
                    f"{self.events:,} events; the capture goes on in memory for at most {more:,} more (a kill would "
                    "lose those)")
            except Exception as exc:  # never fail the user's job over its spill
                more = self._keep_in_memory()
                say(f"memprof: warning: the spill stopped ({one_line(exc)}) after {self.events:,} events; the capture "
                    f"goes on in memory for at most {more:,} more")

    def _keep_in_memory(self) -> int:
        """The spill failed: the store keeps what comes from here on in memory, bounded (events past the
        bound are counted as dropped, and the capture says where). Returns how many more it keeps."""
        self.failed = True
        self.deflater = None  # (its output may be missing from the file: the save deflates the events)
        C = self.native
        bound = min(int(C.max_events()), int(C.event_count()) + self.bound_on_failure)
        C.set_max_events(bound)
        return max(bound - int(C.event_count()), 0)

    def _flush(self) -> None:
        C = self.native
        n = int(C.event_count())
        if self.ring:
            start, carried, context = C.ring_head()
            # the ring moved past what the spill holds (its chunks are freed), the file holds twice it,
            # or known tensors were pruned (those on file are no longer a prefix of the recorder's)
            if (start > self.events or n - self.file_start > 2 * max(n - start, 1)
                    or self.recorded().pruned != self.pruned):
                self._rotate(int(start), memoryview(carried), CarriedBlock.from_native(context), n)
                return
        elif not self.carried_written and C.window_state() in ("open", "closed"):
            # a window opened: its carried blocks' context goes on file once (after their events)
            if self._append(n):
                self._context(CarriedBlock.from_native(C.window_context()))
                self.carried_written = True
            return
        self._append(n)

    def _context(self, blocks: list[CarriedBlock]) -> None:
        if blocks:
            self._record(b"C", json.dumps([b.to_json() for b in blocks], separators=(",", ":")).encode())

    def _rotate(self, start: int, carried: memoryview, context: list[CarriedBlock], n: int) -> None:
        """Write the file anew from the ring's start (beside it, locked, then renamed over it)."""
        new = self.path.with_name(self.path.name + ".new")
        old, self._fd = self._fd, os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        kept = (self.events, self.strings, self.plans, self.graphs, self.tensors, self.threads, self.file_start)
        try:
            try_lock(self._fd)  # the file that takes the spill's name is this process's too
            self._write(MAGIC)
            self._record(b"M", self._meta)
            self.strings = self.plans = self.graphs = self.tensors = 0
            self.threads = []
            self._events_records(carried)
            self._context(context)
            self.events = self.file_start = start
            if not self._append(n):  # the ring moved on meanwhile: the next interval tries again
                raise _Moved
            os.replace(new, self.path)
        except BaseException as exc:
            os.close(self._fd)
            self._fd = old
            (self.events, self.strings, self.plans, self.graphs, self.tensors, self.threads,
             self.file_start) = kept
            with contextlib.suppress(OSError):
                new.unlink()
            if isinstance(exc, _Moved):
                return
            raise
        os.close(old)

    def _events_records(self, data: memoryview) -> None:
        step = RECORD_EVENTS * EVENT_DTYPE.itemsize  # bounded records: a kill mid-write loses one
        for at in range(0, len(data), step):
            self._record(b"E", data[at : at + step])

    def _append(self, n: int) -> bool:
        """Append what was recorded up to event `n`; False when the store no longer holds it."""
        C = self.native
        want = max(n - self.events, 0)
        data = memoryview(b"")
        if self.ring and want:  # (a ring frees chunks as it moves: copied out under the store's lock)
            data = memoryview(C.events_range(self.events, want))
            if len(data) != want * EVENT_DTYPE.itemsize:
                return False
        elif want and C.released_events() > self.events:
            return False
        # read after the events' count: every id events [.., n) use is in. Written before them: a
        # record cut short never leaves events without names
        strings = C.strings_from(self.strings)
        if strings:
            self._record(b"S", json.dumps(strings).encode())
            self.strings += len(strings)
        if self.ring:
            self._events_records(data)
        elif want and C.spill_events(self._fd, self.events, want) != want:
            raise OSError(f"the event store held fewer than the {want:,} events it counted")
        elif want and self.deflater is not None:
            self._deflate(want)
        written = self.events + want
        threads = thread_table()
        if threads != self.threads:
            self._record(b"T", json.dumps(threads).encode())
            self.threads = threads
        plans, graphs, tensors, pruned = self.recorded()
        if len(plans) > self.plans or len(graphs) > self.graphs:
            key = (self.plans, self.graphs, len(plans), len(graphs))
            if self._compiled[0] != key:  # (kept: a ring's spill writes them again at every rewrite)
                new_graphs = graphs[self.graphs:]
                doc = {"plans": [p.to_json() for p in plans[self.plans:]],
                       "graphs": [g.to_json() for g in new_graphs], "sources": [g.source for g in new_graphs]}
                self._compiled = (key, json.dumps(doc, separators=(",", ":")).encode())
            self._record(b"P", self._compiled[1])
            self.plans, self.graphs = len(plans), len(graphs)
        known = len(tensors)  # (read once: the script's thread adds records meanwhile)
        if known > self.tensors:
            rows = tensors.json_rows(self.tensors, known)
            self._record(b"P", TENSORS_RECORD + rows.encode() + b"}")  # ({"tensors": rows})
            self.tensors = known
        if not self.ring:  # (a ring's are pruned, and written anew)
            tensors.release_before(self.tensors)  # on file: `session_tensors` reads them back
        self.pruned = pruned
        if time.monotonic() - self._synced >= SYNC_EVERY_S:  # (written more often when the store fills)
            os.fsync(self._fd)
            self._synced = time.monotonic()
        # on disk now: the native store may free them (its memory stays about one chunk)
        self.events = written
        C.release_events_before(written)
        return True

    def _deflate(self, want: int) -> None:
        """Deflate the events just written (copied from the store, which still holds them) and append
        what the stream has ready: on this thread, beside the script, rather than in the save."""
        for at in range(self.events, self.events + want, RECORD_EVENTS):  # (a record's worth copied at a time)
            take = min(RECORD_EVENTS, self.events + want - at)
            data = self.native.events_range(at, take)
            if self.deflater is None or len(data) != take * EVENT_DTYPE.itemsize:
                self.deflater = None
                return
            packed = self.deflater.feed(memoryview(data))
            if packed:
                self._record(b"Z", packed)

    def session_events(self) -> np.ndarray | SpilledEvents:
        """Every event of the session once it stopped: where the native store freed some (the spill
        holds those), the spill's events where they lie and the store's tail copied
        (`SpilledEvents`: saved by streaming, read into memory only when the analysis asks);
        else the store's, in one array."""
        C = self.native
        if not C.released_events():
            return np.asarray(C.events()).view(EVENT_DTYPE)
        tail = np.asarray(C.events_range(self.events, max(int(C.event_count()) - self.events, 0))).view(EVENT_DTYPE)
        return SpilledEvents(self.path, self.events, tail, self.deflater)

    def session_tensors(self, tensors: Sequence[KnownTensor]) -> list[KnownTensor]:
        """Every known tensor of the session once it stopped: those the recorder let go (`flush`), read
        back from the spill, then the recorder's own."""
        released = tensors.released if isinstance(tensors, KnownTensors) else 0
        try:
            spilled = spilled_tensors(self.path, released) if released else []
        except CaptureFileError as exc:
            spilled = []
            say(f"memprof: warning: {exc}")
        if len(spilled) < released:
            say(f"memprof: warning: {released - len(spilled):,} of the known tensors could not be read back from "
                f"the spill: blocks they named are unattributed")
        return spilled + list(tensors[released:])

    def close(self) -> None:
        """Write what is left and close the file (it stays until the capture is saved). The lock goes
        with the descriptor: a spill is written from here on only to be removed."""
        self.flush()
        with contextlib.suppress(OSError):
            os.fsync(self._fd)
        os.close(self._fd)
