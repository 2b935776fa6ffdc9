"""The .memprof file: a zip container, readable without the native extension, never unpickled.

    meta.json      format name and version, versions, devices, baselines, command, status, notes
    events.npy     the event array (memprof._events.EVENT_DTYPE), numpy format, no pickle
    strings.json   the interned scope names; events' `scope` indexes this list
    threads.json   [{index, tid, name}] for the events' `thread` column
    plans.json     compile plans, compiled graphs (without their source) and known tensors (v2)
    wrappers/N.py  the wrapper source of compiled graph N (v2)

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
    from memprof.plans import CompiledGraph, Plan

FORMAT_NAME = "memprof"
FORMAT_VERSION = 2  # 2: plans.json and wrappers/ (version 1 files still load)


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
            zf.writestr("plans.json", json.dumps({
                "plans": [p.to_json() for p in cap.plans],
                "graphs": [g.to_json() for g in cap.graphs],
                "tensors": [list(t) for t in cap.tensors],
            }, separators=(",", ":")))
            for i, g in enumerate(cap.graphs):
                zf.writestr(f"wrappers/{i}.py", g.source)
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
            plans_doc = _read_json(zf, "plans.json", p) if "plans.json" in names else {}
            sources = {n: zf.read(n).decode("utf-8", "replace") for n in names if n.startswith("wrappers/")}
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
    plans, graphs, tensors = _plans(plans_doc, sources, p)
    meta.pop("format", None)
    meta["format_version_read"] = meta.pop("format_version")
    cap = Capture(raw=raw, strings=strings, meta=meta, threads=threads if isinstance(threads, list) else [],
                  plans=plans, graphs=graphs, tensors=tensors)
    cap.meta["path"] = str(p)
    return cap


def _plans(doc: Any, sources: dict[str, str], path: Path) -> tuple[list[Plan], list[CompiledGraph], list[Any]]:
    from memprof.plans import CompiledGraph, Plan

    if not doc:
        return [], [], []
    try:
        plans = [Plan.from_json(d) for d in doc.get("plans", [])]
        graphs = [CompiledGraph.from_json(d, sources.get(f"wrappers/{i}.py", ""))
                  for i, d in enumerate(doc.get("graphs", []))]
        tensors = [(int(t[0]), str(t[1]), int(t[2]), int(t[3]), str(t[4]), str(t[5])) for t in doc.get("tensors", [])]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CaptureFileError(f"{path}: corrupt capture (bad plans.json: {type(exc).__name__})") from None
    return plans, graphs, tensors
