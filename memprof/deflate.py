"""A capture's events deflated while it runs, so that saving copies them instead of deflating them.

The spill (`memprof.spill`) feeds each run of events it writes to a `StreamDeflater` on the capture's
own thread, beside the script (zlib lets go of the GIL), and keeps its output in the spill. The save
(`memprof.fileformat`) then writes the zip member `events.npy` as the array's header, deflated on its
own and flushed to a byte boundary without ending the stream, followed by that stream: deflate
blocks refer back only within their own stream, so the two join into one valid stream. The
member's CRC-32 is the header's combined with the events' (`crc32_combine`): the events' CRC is
taken as they are fed, before the header (which holds their count) is known.

Where ISA-L's deflate is installed (the `isal` package) the streams are made and read with it: the
same format, made about 4x and read about 2x as fast as zlib's fastest level (its files are about
half as large again: `docs/benchmarks.md`). zlib is the fallback.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import IO, Any, NamedTuple, Protocol, cast

try:
    from isal import isal_zlib as _isal
except ImportError:  # (optional: zlib makes the same format, slower)
    _isal = None  # type: ignore[assignment]

LEVEL = 1  # zlib's and ISA-L's fastest that still looks for matches: the events deflate 6-8x even so


def compressor() -> Any:
    """A raw deflate stream's compressor (`zlib.compressobj`'s interface)."""
    if _isal is not None:
        return _isal.compressobj(LEVEL, _isal.DEFLATED, -15)
    return zlib.compressobj(LEVEL, zlib.DEFLATED, -15)


def decompressor() -> Any:
    """A raw deflate stream's decompressor (`zlib.decompressobj`'s interface; ISA-L's may hold output
    back with no input left unconsumed: a reader calls it until it ends or gives nothing)."""
    return _isal.decompressobj(-15) if _isal is not None else zlib.decompressobj(-15)


# what either library raises on a stream that is not valid deflate
ERRORS: tuple[type[Exception], ...] = (zlib.error,) + (() if _isal is None else (cast(type[Exception], _isal.error),))


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    return int(_isal.crc32(data, value)) if _isal is not None else zlib.crc32(data, value)


_POLY = 0xEDB88320  # CRC-32's polynomial, reflected (zlib's)


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, row) for row in mat]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from A's (`crc1`), B's (`crc2`) and B's length (zlib's `crc32_combine`,
    which Python's zlib does not expose: `crc1` advanced over `len2` zero bytes, by squaring the
    operator of one zero bit, then xor-ed with `crc2`)."""
    if len2 <= 0:  # (B is empty: its CRC is 0)
        return crc1
    op = [_POLY] + [1 << n for n in range(31)]  # the operator for one zero bit
    for _ in range(3):  # squared three times: for one zero byte
        op = _gf2_square(op)
    while len2:  # the operator for 2**k zero bytes, applied where bit k of len2 is set
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
        op = _gf2_square(op)
    return crc1 ^ crc2


class Deflated(NamedTuple):
    """Bytes deflated already: the stream's `pieces` in order (raw deflate, ended), and the CRC-32 and
    size of what they inflate to."""

    pieces: Iterable[bytes | bytearray]
    crc: int
    size: int


class Digest(Protocol):
    """What the deflated bytes inflate to: their CRC-32 and size (read once they are all written)."""

    @property
    def crc(self) -> int: ...
    @property
    def size(self) -> int: ...


class StreamDeflater:
    """Raw deflate of the bytes fed to it, in order, with their CRC-32 and size. `feed` returns what the
    stream has ready (often nothing: zlib holds a window back); `end` ends the stream with the last
    bytes, once (a second call returns the same bytes)."""

    def __init__(self) -> None:
        self._z = compressor()
        self.crc = 0
        self.size = 0
        self._end: bytes | None = None

    def feed(self, data: bytes | memoryview) -> bytes:
        if self._end is not None:
            raise ValueError("the stream has ended")
        self.crc = crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return bytes(self._z.compress(data))

    def end(self, last: bytes | memoryview = b"") -> bytes:
        if self._end is None:
            out = self.feed(last)
            self._end = out + bytes(self._z.flush())
        return self._end


class _AsIs:
    """A zip member's "compressor" that passes bytes deflated already through."""

    @staticmethod
    def compress(data: Any) -> Any:
        return data

    @staticmethod
    def flush() -> bytes:
        return b""


def write_deflated(member: IO[bytes], head: bytes, pieces: Iterable[bytes | bytearray], body: Digest) -> bool:
    """Write a deflated zip member opened for writing (`ZipFile.open(name, "w")`, nothing written yet):
    `head`, deflated here, then `pieces`, a raw deflate stream (ended) of what `body` digests, read once
    they are written (a `Deflated`, or a `StreamDeflater` the pieces are made by as they are taken).
    zipfile writes only what it deflates itself, so the member's writer is given a compressor that
    passes the bytes through, and the size and CRC of what they inflate to before it closes (its
    private fields, as in CPython 3.8 to 3.14). Where the writer is not that one, nothing is written
    and False is returned: the caller writes the member's bytes as usual."""
    if not all(hasattr(member, a) for a in ("_compressor", "_file_size", "_crc")):
        return False
    z = compressor()
    member._compressor = _AsIs()  # type: ignore[attr-defined]
    sync = _isal.Z_SYNC_FLUSH if _isal is not None else zlib.Z_SYNC_FLUSH
    member.write(bytes(z.compress(head)) + bytes(z.flush(sync)))  # (a byte boundary; the stream goes on)
    for piece in pieces:
        if piece:
            member.write(piece)
    member._file_size = len(head) + body.size  # type: ignore[attr-defined]
    member._crc = crc32_combine(crc32(head), body.crc, body.size)  # type: ignore[attr-defined]
    return True
