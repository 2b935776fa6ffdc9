"""A sweep's directory: made ready (`prepare_dir`), and the manifest that lists every file the sweep
wrote in it, which is all `memprof sweep --force` ever removes."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from memprof.errors import MemprofError

# Marks a directory as a sweep memprof wrote, and lists every file the sweep wrote in it: `--force`
# removes only those, never anything the user put there (a file of the same kind included).
MANIFEST = ".memprof-sweep.json"
MANIFEST_VERSION = 2  # 1 listed the kinds of file (patterns), not the files


def _manifest(out: Path) -> dict[str, Any]:
    try:
        doc = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


_manifest_lock = threading.Lock()  # (the sweep's tasks run on threads of their own)


def record_files(out: Path, *names: str) -> None:
    """Add `names` (paths relative to `out`) to the sweep's manifest, before they are written: a
    sweep cut short still lists everything it may have left."""
    with _manifest_lock:
        doc = _manifest(out)
        files = list(dict.fromkeys([*doc.get("files", []), *names]))
        tmp = out / f"{MANIFEST}.tmp"
        tmp.write_text(json.dumps({**doc, "files": files}, indent=0))
        tmp.replace(out / MANIFEST)


def _remove_listed(out: Path, doc: dict[str, Any]) -> None:
    """Remove the files the manifest lists: regular files inside `out`, by their exact names."""
    root = Path(os.path.realpath(out))
    for name in doc.get("files", []):
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            continue
        f = out / name
        if f.is_file() and not f.is_symlink() and root in Path(os.path.realpath(f)).parents:
            f.unlink()


def prepare_dir(out: Path, force: bool, script: Path | None = None) -> None:
    """Make `out` ready for a sweep: a new or empty directory, or with --force a sweep memprof wrote
    before (its manifest), whose listed files are removed. Never the current directory or one holding
    the script; a directory holding anything else is refused in one line."""
    here = Path(os.path.realpath(Path.cwd()))
    real = Path(os.path.realpath(out))
    if out.exists() and not out.is_dir():
        raise MemprofError(f"output {out} exists and is not a directory")
    if real == here or real in here.parents:
        raise MemprofError(f"output directory {out} is the current directory or holds it; give a new directory")
    if script is not None and real in Path(os.path.realpath(script)).parents:
        raise MemprofError(f"output directory {out} holds the script {script}; give a new directory")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise MemprofError(f"output directory {out} exists and is not empty (use --force to replace it)")
        if not (out / MANIFEST).is_file():
            raise MemprofError(f"output directory {out} was not written by memprof sweep (no {MANIFEST}); "
                               "not replacing it: remove it yourself or give a new directory")
        doc = _manifest(out)
        if doc.get("version") != MANIFEST_VERSION:
            raise MemprofError(f"output directory {out} was written by an earlier memprof, whose {MANIFEST} does not "
                               "list its files: not replacing it; remove it yourself or give a new directory")
        _remove_listed(out, doc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    from memprof._version import __version__

    (out / MANIFEST).write_text(json.dumps({"written_by": f"memprof {__version__}", "version": MANIFEST_VERSION,
                                            "files": ["sweep.json"]}))
