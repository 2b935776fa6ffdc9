"""Output files: resolved once at the start, checked against the inputs and each other, written
atomically with the permissions the umask gives.

`trace` and `export` go through `check_outputs` before they run anything, so no output can
overwrite an input or another output, and a script's `os.chdir` cannot move where a relative `-o`
lands; `sweep` checks its output directory with `sweep.runner.prepare_dir`.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

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


def check_writable(path: Path, force: bool, hint: str = "") -> None:
    """Refuse, in one line, an output path memprof could not (or should not) write (`hint`: more words
    for a file that exists)."""
    if path.exists() and path.is_dir():
        raise MemprofError(f"{path} is a directory; give a file name")
    if path.exists() and not force:
        raise MemprofError(f"{path} already exists; pass --force to overwrite it or -o to choose another file{hint}")
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


def check_outputs(outputs: Mapping[str, Path | None], inputs: Iterable[tuple[str, Path]], force: bool,
                  hints: Mapping[str, str] | None = None) -> None:
    """The one check of a command's output files (option -> path; None: not asked for): each is
    writable, none is an input (`inputs`: what -> path) and no two are the same file (`hints`: option
    -> more words for an output that exists)."""
    given = [(opt, p) for opt, p in outputs.items() if p is not None]
    for opt, p in given:
        for what, source in inputs:
            if _same(p, source):
                raise MemprofError(f"{opt} {p} is the {what}; choose another file")
    for i, (opt, p) in enumerate(given):
        for other, q in given[:i]:
            if _same(p, q):
                raise MemprofError(f"{opt} and {other} are the same file ({p}); give each its own")
    for opt, p in given:
        check_writable(p, force, (hints or {}).get(opt, ""))


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[IO[bytes]], object], replace: bool = True) -> Path:
    """Write `path` through a temporary file beside it, moved into place once complete; the file
    gets the permissions a plain `open()` would (0o666 less the umask), and a failed write (a full
    disk) leaves neither a partial file nor the temporary one. Without `replace`, a file at `path`
    (one that appeared meanwhile) is kept and FileExistsError raised: the move is a hard link, which
    never replaces a file."""
    with _atomic(path, replace) as fh:
        write(fh)
    return path


@contextlib.contextmanager
def _atomic(path: Path, replace: bool) -> Iterator[IO[bytes]]:
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())  # mkstemp makes it 0600
            yield fh
        if replace:
            os.replace(tmp, path)
        else:
            _move_new(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class _Deflate(io.RawIOBase):
    """Bytes gzip-compressed and written on a second thread (zlib lets go of the GIL while it
    compresses), so an export's compression overlaps the formatting that feeds it."""

    def __init__(self, fh: IO[bytes], level: int) -> None:
        super().__init__()
        self._gz = gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=level, mtime=0)
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=8)  # at most 8 MB in flight
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="memprof-gzip", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._gz.write(chunk)
                except BaseException as exc:  # (a full disk) raised where the writer next writes
                    self._error = exc

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._error is not None:
            raise self._error
        chunk = bytes(data)
        self._queue.put(chunk)
        return len(chunk)

    def close(self) -> None:
        if not self.closed:
            self._queue.put(None)
            self._thread.join()
            if self._error is None:
                self._gz.close()
        super().close()
        if self._error is not None:
            raise self._error


@contextlib.contextmanager
def output_stream(path: Path, binary: bool = False, replace: bool = True) -> Iterator[IO[Any]]:
    """A file object that writes `path` as `atomic_write` does (nothing at `path` until it closes
    without error), gzip-compressed where the name ends in `.gz` (Perfetto opens a `.json.gz` trace
    as it is; zlib's fastest level: its cost against the default's in docs/benchmarks.md, session
    9); text is written as UTF-8 unless `binary`."""
    with _atomic(path, replace) as fh:
        deflate = _Deflate(fh, 1) if path.name.endswith(".gz") else None
        raw: IO[bytes] = fh if deflate is None else io.BufferedWriter(deflate, 1 << 20)  # type: ignore[assignment]
        try:
            if binary:
                yield raw
            else:
                text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
                yield text
                text.detach()  # (flushes it; `raw` stays open)
            raw.flush()
        finally:
            if deflate is not None:
                deflate.close()  # (after an error too: its thread ends; the partial file goes)


def _move_new(tmp: str, path: Path) -> None:
    try:
        os.link(tmp, path)  # FileExistsError where a file is there
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: the check and the rename are apart
        if path.exists():
            raise FileExistsError(str(path)) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def free_name(path: Path) -> Path:
    """The first `NAME.N.SUFFIX` beside `path` that does not exist (`run.memprof` -> `run.1.memprof`)."""
    n = 1
    while (candidate := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    return candidate


def write_text(path: Path, text: str, replace: bool = True) -> Path:
    """`atomic_write` of a UTF-8 text."""
    return atomic_write(path, lambda fh: fh.write(text.encode("utf-8")), replace)


def write_output(path: Path, data: str | bytes, replace: bool = True) -> Path:
    """`output_stream` of an export held in memory."""
    with output_stream(path, binary=isinstance(data, bytes), replace=replace) as out:
        out.write(data)
    return path


def existing_file(path: str | os.PathLike[str], missing: str, directory: str,
                  error: type[MemprofError] = MemprofError) -> Path:
    """`path` when it is an existing regular file; else `error` with the `missing` or the `directory`
    message, or that it is no regular file (a device such as /dev/zero, a FIFO: reading one would
    never end, or never begin)."""
    p = Path(path)
    if not p.exists():
        raise error(missing)
    if p.is_dir():
        raise error(directory)
    if not p.is_file():
        raise error(f"{path} is not a regular file")
    return p


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def json_text(value: Any, **options: Any) -> str:
    """JSON that every parser reads: NaN and infinities (a capture's odd budget, say) are written as
    null, and whoever wrote them says so beside them (`Capture.caveats`)."""
    return json.dumps(_finite(value), allow_nan=False, **options)
