"""Reading a spill (`memprof.spill` writes them): its records, its events, and the capture it holds
when its run was cut short (`read`)."""

from __future__ import annotations

import fcntl
import io
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from memprof._events import EVENT_DTYPE, Events, Kind
from memprof.deflate import Deflated, StreamDeflater
from memprof.errors import CaptureFileError
from memprof.event_checks import check_fits
from memprof.fileformat import Parts, checked, loads_json
from memprof.plans import KnownTensor

MAGIC = b"MEMPROF-SPILL 1\n"
HEAD = struct.Struct("<cQ")  # a record's type byte and its payload's length
TENSORS_RECORD = b'{"tensors":'  # how a P record of known tensors begins (`SpillWriter` writes it so)


def try_lock(fd: int) -> bool:
    """Take the spill's lock for this process (False: another process holds it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


Record = tuple[bytes, int, int]  # type, payload offset, payload length


def index_records(f: io.BufferedReader, path: Path) -> list[Record]:
    """The spill's records, up to the one a kill cut short (headers read, payloads skipped)."""
    if f.read(len(MAGIC)) != MAGIC:
        raise CaptureFileError(f"{path}: not a memprof spill")
    size, out = os.fstat(f.fileno()).st_size, []
    while len(head := f.read(HEAD.size)) == HEAD.size:
        kind, length = HEAD.unpack(head)
        at = f.tell()
        if at + length > size:
            break  # the record a kill cut short
        out.append((kind, at, length))
        f.seek(length, os.SEEK_CUR)
    return out


def event_parts(records: list[Record]) -> list[tuple[int, int]]:
    """The E records' payloads (offset, length), in order, each without a torn tail."""
    size = EVENT_DTYPE.itemsize
    return [(at, n - n % size) for kind, at, n in records if kind == b"E"]


def event_count(parts: list[tuple[int, int]]) -> int:
    return sum(n for _at, n in parts) // EVENT_DTYPE.itemsize


def read_into(f: io.BufferedReader, out: np.ndarray, parts: list[tuple[int, int]], n: int) -> None:
    """Read the first `n` events of `parts` straight into the start of `out`, at their offsets
    (`pread`: the descriptor's position is not used, so two threads may read one spill at once)."""
    flat, at, end = memoryview(out.view(np.uint8)), 0, n * EVENT_DTYPE.itemsize  # type: ignore[arg-type]
    for offset, length in parts:
        take = min(length, end - at)
        if take <= 0:
            break
        pread_exactly(f, flat[at : at + take], offset)
        at += take


def pread_exactly(f: io.BufferedReader, view: memoryview, offset: int) -> None:
    """Fill `view` with the file's bytes from `offset` (`pread`, as `read_into`)."""
    done, fd = 0, f.fileno()
    while done < len(view):  # (one call reads at most about 2 GB)
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CaptureFileError(f"{f.name}: the spill changed while it was read")
        done += got


class SpilledEvents:
    """A stopped session's events where they lie: the spill's event records, read through a descriptor
    held open (the spill can be removed meanwhile: its data stays until this closes), then `tail`,
    the events the store recorded after the last write. `chunks` streams them a record at a time (the
    capture file is written from them with memory bounded by one record); `read` makes the columns
    the analysis needs. Both read at offsets, so the save and the summary may read at once, on two
    threads; the descriptor closes with this object (or `close`)."""

    def __init__(self, path: Path, written: int, tail: np.ndarray, deflater: StreamDeflater | None = None) -> None:
        self._f: io.BufferedReader | None = open(path, "rb")  # noqa: SIM115  (held open on purpose)
        records = index_records(self._f, path)
        self._parts = event_parts(records)
        self.head = min(event_count(self._parts), written)
        self.tail = tail
        # the spill's deflated events (`Z` records) with the stream that made them, where they are
        # exactly the head's events: then `deflated` gives the file's stream without deflating again
        exact = deflater is not None and deflater.size == self.head * EVENT_DTYPE.itemsize
        self._deflater = deflater if exact else None
        self._packed = [(at, n) for kind, at, n in records if kind == b"Z"]

    def __len__(self) -> int:
        return self.head + len(self.tail)

    def _file(self) -> io.BufferedReader:
        if self._f is None:
            raise CaptureFileError("the spilled events were closed")
        return self._f

    def chunks(self) -> Iterator[np.ndarray]:
        f, left = self._file(), self.head
        for offset, length in self._parts:
            take = min(length // EVENT_DTYPE.itemsize, left)
            if take <= 0:
                break
            out = np.empty(take, dtype=EVENT_DTYPE)
            read_into(f, out, [(offset, take * EVENT_DTYPE.itemsize)], take)
            left -= take
            yield out
        if len(self.tail):
            yield self.tail

    def deflated(self) -> Deflated | None:
        """Every event's bytes deflated as a zip member holds them (the spill's `Z` records, then the
        tail's), where the spill deflated them as it wrote them; else None."""
        if self._deflater is None:
            return None
        f = self._file()
        end = self._deflater.end(memoryview(np.ascontiguousarray(self.tail).view(np.uint8)))  # type: ignore[arg-type]

        def pieces() -> Iterator[bytes | bytearray]:
            for at, n in self._packed:
                out = bytearray(n)
                pread_exactly(f, memoryview(out), at)
                yield out
            yield end

        return Deflated(pieces(), self._deflater.crc, self._deflater.size)

    def read(self) -> Events:
        """Every event, in columns (`Events`: a chunk in memory at a time beside them)."""
        return Events.from_chunks(len(self), self.chunks())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __del__(self) -> None:  # a capture never read: its removed spill's space is given back with it
        self.close()


def spilled_tensors(path: Path, n: int) -> list[KnownTensor]:
    """The first `n` known tensors the spill at `path` holds (its P records of known tensors, not
    those of compile plans, which can take megabytes), in the order written: fewer where it holds fewer."""
    out: list[KnownTensor] = []
    try:
        with open(path, "rb") as f:
            for kind, at, length in index_records(f, path):
                if kind != b"P" or len(out) >= n:
                    continue
                f.seek(at)
                head = f.read(len(TENSORS_RECORD))
                if head != TENSORS_RECORD:
                    continue
                value = loads_json(head + f.read(length - len(head)), "spill record P", path)
                out += [KnownTensor.from_json(t) for t in value["tensors"][: n - len(out)]]
    except OSError as exc:
        raise CaptureFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise CaptureFileError(f"{path}: corrupt spill (bad known tensors: {type(exc).__name__})") from None
    return out


def read(path: Path) -> Parts:
    """The capture a spill holds, marked as cut short (`Capture.caveats` says what was lost), or as
    still running where its writer holds it."""
    try:
        with open(path, "rb") as f:
            live = not try_lock(f.fileno())
            return _parts(f, index_records(f, path), path, live)
    except OSError as exc:
        raise CaptureFileError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _parts(f: io.BufferedReader, records: list[Record], path: Path, live: bool = False) -> Parts:
    meta: dict[str, Any] = {}
    strings: list[Any] = []
    threads: Any = []
    doc: dict[str, list[Any]] = {"plans": [], "graphs": [], "tensors": []}
    carried: Any = []
    sources: dict[str, str] = {}
    for kind, at, length in records:
        if kind in (b"E", b"Z"):  # (the deflated events are of no use without the stream's state)
            continue
        f.seek(at)
        value = loads_json(f.read(length), f"spill record {kind.decode(errors='replace')}", path)
        if kind == b"M" and isinstance(value, dict):
            meta = value
        elif kind == b"S" and isinstance(value, list):
            strings += value
        elif kind == b"T":
            threads = value
        elif kind == b"C":
            carried = value
        elif kind == b"P" and isinstance(value, dict):
            for src in value.get("sources", []):
                sources[f"wrappers/{len(sources)}.py"] = str(src)
            for key in doc:
                doc[key] += list(value.get(key, []))
    parts = event_parts(records)
    check_fits(event_count(parts), path, "spill")
    raw = np.empty(event_count(parts), dtype=EVENT_DTYPE)
    read_into(f, raw, parts, len(raw))
    last = int(raw["t_ns"].max()) if len(raw) else int(meta.get("t_start_ns") or 0)
    markers = raw["bytes"][raw["kind"] == Kind.STEP]
    meta.update(status="running" if live else "cut short", recovered_from=str(path), t_stop_ns=last,
                path=str(path), steps=int(markers.max()) if len(markers) else 0)
    main = [t.get("index") for t in threads if isinstance(t, dict) and t.get("tid") == meta.get("native_tid")]
    if not main and len(raw):  # no thread table written yet: the capture starts on its own thread
        main = [int(raw["thread"][0])]
    meta.setdefault("main_thread", main[0] if main else None)
    return checked(Events.of(raw), strings, meta, threads, doc, sources, path, carried)
