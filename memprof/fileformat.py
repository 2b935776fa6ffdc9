"""The .memprof file: a zip container, readable without the native extension, never unpickled.

    meta.json      format name and version, versions, devices, baselines, command, status, notes
    events.npy     the event array (memprof._events.EVENT_DTYPE), numpy format, no pickle
    strings.json   the interned scope names; events' `scope` indexes this list
    threads.json   [{index, tid, name}] for the events' `thread` column

A file of a newer format version, a truncated or corrupt file, or a file that is not a
memprof capture is refused with a one-line CaptureFileError.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memprof._events import EVENT_DTYPE
from memprof.errors import CaptureFileError, MemprofError

if TYPE_CHECKING:
    from memprof.capture import Capture

FORMAT_NAME = "memprof"
FORMAT_VERSION = 1


def check_writable(path: Path, force: bool) -> None:
    """Refuse, in one line, an output path memprof could not (or should not) write."""
    if path.exists() and path.is_dir():
        raise MemprofError(f"{path} is a directory; give a file name")
    if path.exists() and not force:
        raise MemprofError(f"{path} already exists; pass --force to overwrite it or -o to choose another file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise MemprofError(f"output directory {parent} does not exist")
    if not parent.is_dir():
        raise MemprofError(f"output directory {parent} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".memprof-probe-"):
            pass
    except OSError as exc:
        raise MemprofError(f"cannot write to output directory {parent}: {exc.strerror or exc}") from None


def save(cap: Capture, path: Path) -> Path:
    """Write `cap` to `path` atomically (a temporary file renamed into place)."""
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **cap.meta}
    events = io.BytesIO()
    np.save(events, np.ascontiguousarray(cap.raw), allow_pickle=False)
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
            zf.writestr("meta.json", json.dumps(meta, indent=1, default=str))
            zf.writestr("events.npy", events.getvalue())
            zf.writestr("strings.json", json.dumps(cap.strings))
            zf.writestr("threads.json", json.dumps(cap.threads))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _read_json(zf: zipfile.ZipFile, name: str, path: Path) -> Any:
    try:
        return json.loads(zf.read(name).decode("utf-8"))
    except KeyError:
        raise CaptureFileError(f"{path}: corrupt capture (missing {name})") from None
    except (ValueError, UnicodeDecodeError):
        raise CaptureFileError(f"{path}: corrupt capture ({name} is not valid JSON)") from None


def load(path: str | os.PathLike[str]) -> Capture:
    """Read a .memprof file written by `Capture.save` or `memprof trace`."""
    from memprof.capture import Capture

    p = Path(path)
    if not p.exists():
        raise CaptureFileError(f"{p}: no such file")
    if p.is_dir():
        raise CaptureFileError(f"{p} is a directory, not a capture file")
    try:
        with zipfile.ZipFile(p) as zf:
            names = set(zf.namelist())
            if "meta.json" not in names:
                raise CaptureFileError(f"{p}: not a memprof capture (no meta.json)")
            meta = _read_json(zf, "meta.json", p)
            if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
                raise CaptureFileError(f"{p}: not a memprof capture")
            version = meta.get("format_version")
            if not isinstance(version, int) or version < 1:
                raise CaptureFileError(f"{p}: unknown capture format version {version!r}")
            if version > FORMAT_VERSION:
                raise CaptureFileError(
                    f"{p}: written by a newer memprof (format version {version}; this memprof "
                    f"reads up to {FORMAT_VERSION}): upgrade memprof to read it"
                )
            try:
                raw = np.load(io.BytesIO(zf.read("events.npy")), allow_pickle=False)
            except KeyError:
                raise CaptureFileError(f"{p}: corrupt capture (missing events.npy)") from None
            strings = _read_json(zf, "strings.json", p)
            threads = _read_json(zf, "threads.json", p)
    except CaptureFileError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError):
        raise CaptureFileError(f"{p}: truncated or corrupt capture (not a readable memprof file)") from None
    except ValueError as exc:
        raise CaptureFileError(f"{p}: corrupt capture ({exc})") from None
    except OSError as exc:
        raise CaptureFileError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if raw.dtype != EVENT_DTYPE or raw.ndim != 1:
        raise CaptureFileError(f"{p}: corrupt capture (events have an unexpected layout)")
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise CaptureFileError(f"{p}: corrupt capture (bad string table)")
    if len(raw) and int(raw["scope"].max()) >= len(strings):
        raise CaptureFileError(f"{p}: corrupt capture (scope ids outside the string table)")
    meta.pop("format", None)
    meta["format_version_read"] = meta.pop("format_version")
    cap = Capture(raw=raw, strings=strings, meta=meta, threads=threads if isinstance(threads, list) else [])
    cap.meta["path"] = str(p)
    return cap
