"""The .memprof file: a zip container, readable without the native extension, never unpickled.

    meta.json      format name and version, versions, devices, baselines, command, status, notes
    events.npy     the event array (memprof._events.EVENT_DTYPE), numpy format, no pickle
    strings.json   the interned scope names; events' `scope` indexes this list
    threads.json   [{index, tid, name}] for the events' `thread` column
    plans.json     compile plans, compiled graphs (without their source) and known tensors (v2)
    wrappers/N.py  the wrapper source of compiled graph N (v2)
    carried.json   where the blocks carried into a step window or a ring were allocated (optional)

A file of a newer format version, a truncated or corrupt file, or a file that is not a
memprof capture is refused with a one-line CaptureFileError.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol

import numpy as np

from memprof._events import EVENT_DTYPE, FLAG_CARRIED, CarriedBlock, Events, EventsBuilder, Kind, kind_mask
from memprof.capture_info import conform, meta_problem
from memprof.deflate import Deflated, StreamDeflater, write_deflated
from memprof.errors import CaptureFileError
from memprof.event_checks import check_events, check_fits
from memprof.inflate import member_pieces, read_ahead
from memprof.outputs import atomic_write, existing_file
from memprof.plans import CompiledGraph, KnownTensor, Plan

FORMAT_NAME = "memprof"
FORMAT_VERSION = 2  # 2: plans.json and wrappers/ (version 1 files still load)


class EventSource(Protocol):
    """Events not read into memory yet (a stopped session's spill, `memprof.spill_read.SpilledEvents`):
    `chunks` streams them in order, `read` makes their columns."""

    def __len__(self) -> int: ...

    def chunks(self) -> Iterator[np.ndarray]: ...

    def read(self) -> Events: ...

    def deflated(self) -> Deflated | None: ...


class Parts(NamedTuple):
    """What a .memprof file holds (`memprof.capture.Capture` is built from these; a capture being saved
    may give its events as an `EventSource`, written a chunk at a time)."""

    raw: Events | EventSource
    strings: list[str]
    meta: dict[str, Any]
    threads: list[dict[str, Any]]
    plans: list[Plan]
    graphs: list[CompiledGraph]
    tensors: list[KnownTensor]
    carried: list[CarriedBlock]


def save(cap: Parts, path: Path, overwrite: bool = True) -> Path:
    """Write a capture's parts to `path` atomically (a temporary file moved into place,
    `outputs.atomic_write`; without `overwrite`, a file at `path` is kept: FileExistsError)."""
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **conform(cap.meta)}

    def write(fh: IO[bytes]) -> None:
        with zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
            zf.writestr("meta.json", json.dumps(meta, indent=1, default=str))
            # streamed into the member in numpy's chunks, or the source's: no second copy of the events
            with zf.open("events.npy", "w", force_zip64=True) as member:
                _write_events(member, cap.raw)
            zf.writestr("strings.json", json.dumps(cap.strings))
            zf.writestr("threads.json", json.dumps(cap.threads))
            zf.writestr("plans.json", json.dumps({
                "plans": [p.to_json() for p in cap.plans],
                "graphs": [g.to_json() for g in cap.graphs],
                "tensors": [t.to_json() for t in cap.tensors],
            }, separators=(",", ":")))
            for i, g in enumerate(cap.graphs):
                zf.writestr(f"wrappers/{i}.py", g.source)
            if cap.carried:
                zf.writestr("carried.json", json.dumps([b.to_json() for b in cap.carried], separators=(",", ":")))

    return atomic_write(path, write, overwrite)


def _write_events(member: IO[bytes], raw: Events | EventSource) -> None:
    """events.npy: the header numpy would write for the array, then the records a chunk at a time
    (never one copy of them all), or their bytes as the source deflated them while the capture ran."""
    head = io.BytesIO()
    header = np.lib.format.header_data_from_array_1_0(np.empty(0, dtype=EVENT_DTYPE))
    np.lib.format.write_array_header_1_0(head, {**header, "shape": (len(raw),)})
    deflated = None if isinstance(raw, Events) else raw.deflated()
    if deflated is not None and write_deflated(member, head.getvalue(), deflated.pieces, deflated):
        return
    stream = StreamDeflater()  # (memprof's deflate: ISA-L's where installed, several times zipfile's speed)

    def pieces() -> Iterator[bytes]:
        for records in _records(raw):
            yield stream.feed(records)
        yield stream.end()

    if write_deflated(member, head.getvalue(), pieces(), stream):
        return
    member.write(head.getvalue())
    for records in _records(raw):
        member.write(records)


def _records(raw: Events | EventSource) -> Iterator[memoryview]:
    """The events' records a chunk at a time, then checks that the source gave as many as it holds."""
    written = 0
    for chunk in raw.chunks():
        yield np.ascontiguousarray(chunk).view(np.uint8).data
        written += len(chunk)
    if written != len(raw):
        raise OSError(f"the events source gave {written:,} events of the {len(raw):,} it holds")


# Members are decompressed only up to their declared size, and that is checked first against the
# compressed size: a real capture compresses its events about 8x (repetitive loops included) and its
# JSON and wrapper text rarely past 20x, while a zip bomb's ratio runs to 1000x.
_MAX_RATIO = {"events.npy": 64}
_TEXT_RATIO = 100
_SLACK = 1 << 20
# What all the members may declare together: the largest ratio of the whole file, and slack once. A
# real capture has a few members and one per compiled graph.
_MAX_MEMBERS = 1 << 16


def _check_archive(zf: zipfile.ZipFile, size: int, path: Path) -> None:
    """Before any member is read: no member declares more compressed bytes than the file holds, and
    all together declare no more than a memprof file of this size can hold (many members each within
    its own slack add up: the total is bounded, not only each one)."""
    infos = zf.infolist()
    if len(infos) > _MAX_MEMBERS:
        raise CaptureFileError(f"{path}: corrupt capture ({len(infos):,} members: not a memprof file)")
    for info in infos:
        if info.compress_size > size or info.header_offset + info.compress_size > size:
            raise CaptureFileError(f"{path}: corrupt capture ({_clip(info.filename)} declares {info.compress_size:,} "
                                   f"compressed bytes in a file of {size:,})")
    total = sum(info.file_size for info in infos)
    if total > _MAX_RATIO["events.npy"] * size + _SLACK:
        raise CaptureFileError(f"{path}: corrupt capture (its members declare {total:,} bytes from a file of "
                               f"{size:,}: not a memprof file's ratio)")
_MAX_JSON_DEPTH = 64


def _clip(value: Any, limit: int = 60) -> str:
    """A value from a file, for an error line: repr'd, at most `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_member(info: zipfile.ZipInfo, path: Path) -> None:
    name = _clip(info.filename)
    if info.flag_bits & 0x1:
        raise CaptureFileError(f"{path}: corrupt capture ({name} is encrypted)")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise CaptureFileError(f"{path}: corrupt capture ({name} uses an unsupported compression)")
    ratio = _MAX_RATIO.get(info.filename, _TEXT_RATIO)
    if info.file_size > ratio * info.compress_size + _SLACK:
        raise CaptureFileError(f"{path}: corrupt capture ({name} declares {info.file_size:,} bytes from "
                               f"{info.compress_size:,} compressed: not a memprof file's ratio)")


def _info(zf: zipfile.ZipFile, name: str, path: Path) -> zipfile.ZipInfo:
    """A member's entry, checked (`_check_member`) before anything of it is read."""
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise CaptureFileError(f"{path}: corrupt capture (missing {name})") from None
    _check_member(info, path)
    return info


def _read(zf: zipfile.ZipFile, name: str, path: Path) -> bytes:
    info = _info(zf, name, path)
    with zf.open(info) as fh:  # zipfile stops at the declared size and checks the CRC
        return fh.read(info.file_size + 1)


_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_NESTING_STEP = np.zeros(256, np.int8)
_NESTING_STEP[list(b"[{")], _NESTING_STEP[list(b"]}")] = 1, -1


def json_depth(text: bytes) -> int:
    """How deep valid JSON text nests its arrays and objects, read from the text in columns (faster
    than a walk of the parsed value, whose every item is looked at). Escaped backslashes, then
    escaped quotes, are dropped first (left to right, as JSON pairs them), so every quote left opens or
    closes a string; brackets inside strings do not count (UTF-8 keeps every ASCII byte its own)."""
    kept = text.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    a = np.frombuffer(kept, np.uint8)
    quote = a == ord('"')
    outside = (np.cumsum(quote) & 1) == 0
    return int(np.cumsum(np.where(outside & ~quote, _NESTING_STEP[a], 0), dtype=np.int64).max(initial=0))


def _read_json(zf: zipfile.ZipFile, name: str, path: Path) -> Any:
    return loads_json(_read(zf, name, path), name, path)


def loads_json(data: bytes, name: str, path: Path) -> Any:
    """A JSON member of a capture (or a spill record), refused in one line when invalid or nested
    too deeply."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CaptureFileError(f"{path}: corrupt capture ({name} is not valid JSON)") from None
    if isinstance(value, (dict, list)) and json_depth(data) > _MAX_JSON_DEPTH:
        raise CaptureFileError(f"{path}: corrupt capture ({name} is nested too deeply)")
    return value


def _read_events(zf: zipfile.ZipFile, path: Path) -> Events:
    """events.npy: its header checked against the member's declared size before the data is read."""
    info = _info(zf, "events.npy", path)
    bad = f"{path}: corrupt capture (events.npy is not a memprof event array)"
    with zf.open(info) as fh:
        try:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                raise CaptureFileError(bad)
        except (ValueError, SyntaxError, TypeError, EOFError, OSError):
            raise CaptureFileError(bad) from None
        if dtype != EVENT_DTYPE or len(shape) != 1 or fortran:
            raise CaptureFileError(f"{path}: corrupt capture (events have an unexpected layout)")
        n = int(shape[0])
        if n < 0 or fh.tell() + n * EVENT_DTYPE.itemsize != info.file_size:
            raise CaptureFileError(f"{path}: corrupt capture (events.npy claims {n:,} events, "
                                   f"its size holds {max(info.file_size - fh.tell(), 0) // EVENT_DTYPE.itemsize:,})")
        check_fits(n, path)
        start = fh.tell()
    return _events_of(read_ahead(member_pieces(path, info, _clip(info.filename))), start, n)


def _events_of(pieces: Iterator[bytes], start: int, n: int) -> Events:
    """The events of a member's pieces, into columns as they come (`EventsBuilder`): never the
    whole member's bytes, nor an array of its records, in memory at once. `start`: the header's bytes."""
    builder, size = EventsBuilder(n), EVENT_DTYPE.itemsize
    held = b""  # the header's bytes, then a record split between two pieces
    for piece in pieces:
        data = held + piece if held else piece
        if start:
            skip = min(start, len(data))
            data, start = data[skip:], start - skip
        whole = len(data) // size
        builder.add(np.frombuffer(data, dtype=EVENT_DTYPE, count=whole))
        held = data[whole * size :]
    return builder.finish()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_count(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _check_meta(meta: dict[str, Any], path: Path) -> None:
    problem = meta_problem(meta)
    if problem is not None:
        key = problem.split(" ", 1)[0]
        raise CaptureFileError(f"{path}: corrupt capture (meta.json {problem}: {_clip(meta[key])})")


def _check_threads(threads: Any, path: Path) -> list[dict[str, Any]]:
    ok = isinstance(threads, list) and all(
        isinstance(t, dict) and _is_int(t.get("index")) and _is_int(t.get("tid")) and isinstance(t.get("name"), str)
        for t in threads)
    if not ok:
        raise CaptureFileError(f"{path}: corrupt capture (threads.json is not a list of {{index, tid, name}})")
    return list(threads)


def read(path: str | os.PathLike[str]) -> Parts:
    """Read a .memprof file written by `Capture.save` or `memprof trace` (`memprof.load` makes a
    `Capture` of it).

    Every member is checked before it is used (declared sizes against the file, JSON types, event
    fields in range): a truncated, corrupt or hostile file is refused with one CaptureFileError line."""
    p = existing_file(path, f"{path}: no such file", f"{path} is a directory, not a capture file", CaptureFileError)
    try:
        with zipfile.ZipFile(p) as zf:
            _check_archive(zf, p.stat().st_size, p)
            names = set(zf.namelist())
            if "meta.json" not in names:
                raise CaptureFileError(f"{p}: not a memprof capture (no meta.json)")
            meta = _read_json(zf, "meta.json", p)
            if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
                raise CaptureFileError(f"{p}: not a memprof capture")
            version: Any = meta.get("format_version")
            if not _is_int(version) or version < 1:
                raise CaptureFileError(f"{p}: unknown capture format version {_clip(version)}")
            if version > FORMAT_VERSION:
                raise CaptureFileError(
                    f"{p}: written by a newer memprof (format version {version}; this memprof "
                    f"reads up to {FORMAT_VERSION}): upgrade memprof to read it"
                )
            raw = _read_events(zf, p)
            strings = _read_json(zf, "strings.json", p)
            threads = _read_json(zf, "threads.json", p)
            plans_doc = _read_json(zf, "plans.json", p) if "plans.json" in names else {}
            sources = {n: _read(zf, n, p).decode("utf-8", "replace") for n in names if n.startswith("wrappers/")}
            carried = _read_json(zf, "carried.json", p) if "carried.json" in names else []
    except CaptureFileError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError):
        if _is_script(p):
            raise CaptureFileError(f"{p} is a Python script, not a capture: memprof trace {p} [ARGS] records one "
                                   "(memprof report reads the .memprof file it writes)") from None
        raise CaptureFileError(f"{p}: truncated or corrupt capture (not a readable memprof file)") from None
    except (ValueError, NotImplementedError, RuntimeError) as exc:
        raise CaptureFileError(f"{p}: corrupt capture ({_clip(str(exc), 120)})") from None
    except OSError as exc:
        raise CaptureFileError(f"{p}: cannot read ({exc.strerror or exc})") from None
    meta.pop("format", None)
    meta["format_version_read"] = meta.pop("format_version")
    meta["path"] = str(p)
    return checked(raw, strings, meta, threads, plans_doc, sources, p, carried)


def _is_script(path: Path) -> bool:
    """Whether a file that is no zip is a Python script (a slip of `report` for `trace`)."""
    if path.suffix in (".py", ".pyw"):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]


def checked(raw: Events, strings: Any, meta: dict[str, Any], threads: Any, plans_doc: Any,
            sources: dict[str, str], path: Path, carried: Any = ()) -> Parts:
    """A capture's parts, each checked (types, event fields in range); one CaptureFileError line
    otherwise. (`read`, and the spill's recovery.)"""
    if not isinstance(strings, list) or not strings or not all(isinstance(s, str) for s in strings):
        raise CaptureFileError(f"{path}: corrupt capture (bad string table)")
    _check_meta(meta, path)
    check_events(raw, strings, path)
    plans, graphs, tensors = _plans(plans_doc, sources, path)
    return Parts(raw, strings, meta, _check_threads(threads, path), plans, graphs, tensors,
                 _carried(carried, raw, len(strings), path))


def _carried(doc: Any, raw: Events, strings: int, path: Path) -> list[CarriedBlock]:
    """carried.json: [[row, [[scope, occurrence], ...], ordinal], ...], each row a carried allocation."""
    bad = f"{path}: corrupt capture (bad carried.json)"
    if not isinstance(doc, list | tuple):
        raise CaptureFileError(bad)
    out: list[CarriedBlock] = []
    carried_alloc = ((raw["flags"] & FLAG_CARRIED) != 0) & kind_mask(raw["kind"], [Kind.ALLOC, Kind.CUDA_ALLOC])
    for entry in doc:
        if not (isinstance(entry, list) and len(entry) == 3 and _is_count(entry[0]) and _is_count(entry[2])
                and isinstance(entry[1], list)):
            raise CaptureFileError(bad)
        row, frames, ordinal = entry
        if row >= len(raw) or not carried_alloc[row] or ordinal >= 1 << 32:
            raise CaptureFileError(f"{path}: corrupt capture (carried.json names row {_clip(row)}, not a carried "
                                   "allocation)")
        if not all(isinstance(f, list) and len(f) == 2 and _is_count(f[0]) and f[0] < strings
                   and _is_count(f[1]) and f[1] < 1 << 32 for f in frames):
            raise CaptureFileError(bad)
        out.append(CarriedBlock(row, tuple((f[0], f[1]) for f in frames), ordinal))
    return out


def _plans(doc: Any, sources: dict[str, str], path: Path) -> tuple[list[Plan], list[CompiledGraph], list[KnownTensor]]:
    if not doc:
        return [], [], []
    try:
        if not isinstance(doc, dict):
            raise TypeError("not an object")
        plans = [Plan.from_json(d) for d in doc.get("plans", [])]
        graphs = [CompiledGraph.from_json(d, sources.get(f"wrappers/{i}.py", ""))
                  for i, d in enumerate(doc.get("graphs", []))]
        tensors = [KnownTensor.from_json(t) for t in doc.get("tensors", [])]
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
        raise CaptureFileError(f"{path}: corrupt capture (bad plans.json: {type(exc).__name__})") from None
    return plans, graphs, tensors
