"""Output files: resolved once at the start, checked against the inputs and each other, written
atomically with the permissions the umask gives.

`trace` and `export` go through `check_outputs` before they run anything, so no output can
overwrite an input or another output, and a script's `os.chdir` cannot move where a relative `-o`
lands; `sweep` checks its output directory with `sweep.runner.prepare_dir`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO

from memprof.errors import MemprofError


def resolve(path: str | os.PathLike[str]) -> Path:
    """An absolute path for `path` against the current directory now (symlinks kept)."""
    return Path(os.path.abspath(os.fspath(path)))


def shown(path: Path, base: Path) -> str:
    """`path` as a user reads it: relative to `base` (the launch directory) when inside it."""
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def _same(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


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


def check_outputs(outputs: Mapping[str, Path | None], inputs: Iterable[tuple[str, Path]], force: bool) -> None:
    """The one check of a command's output files (option -> path; None: not asked for): each is
    writable, none is an input (`inputs`: what -> path) and no two are the same file."""
    given = [(opt, p) for opt, p in outputs.items() if p is not None]
    for opt, p in given:
        for what, source in inputs:
            if _same(p, source):
                raise MemprofError(f"{opt} {p} is the {what}; choose another file")
    for i, (opt, p) in enumerate(given):
        for other, q in given[:i]:
            if _same(p, q):
                raise MemprofError(f"{opt} and {other} are the same file ({p}); give each its own")
    for _opt, p in given:
        check_writable(p, force)


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write `path` through a temporary file beside it, renamed into place once complete; the file
    gets the permissions a plain `open()` would (0o666 less the umask), and a failed write (a full
    disk) leaves neither a partial file nor the temporary one."""
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())  # mkstemp makes it 0600
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """`atomic_write` of a UTF-8 text."""
    return atomic_write(path, lambda fh: fh.write(text.encode("utf-8")))


def existing_file(path: str | os.PathLike[str], missing: str, directory: str,
                  error: type[MemprofError] = MemprofError) -> Path:
    """`path` when it is an existing file; else `error` with the `missing` or the `directory` message."""
    p = Path(path)
    if not p.exists():
        raise error(missing)
    if p.is_dir():
        raise error(directory)
    return p
