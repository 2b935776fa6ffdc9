"""A zip member read a piece at a time, fast and bounded (`memprof.fileformat`'s events): its bytes
found from its local header, inflated a piece at a time and never past its declared size, and
checked against its CRC once the last piece is given."""

from __future__ import annotations

import queue
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

from memprof.deflate import ERRORS, crc32, decompressor
from memprof.errors import CaptureFileError

_PIECE = 4 << 20  # what one piece holds at most: it stays in the cache while the reader takes it in


def member_pieces(path: Path, info: zipfile.ZipInfo, name: str) -> Iterator[bytes]:
    """A member's bytes (`inflate`d where deflated), in order, a piece at a time; after the last,
    its size and CRC are checked. `name`: the member's, as an error line shows it."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise CaptureFileError(f"{path}: corrupt capture ({name} has no local header)")
        name_len, extra_len = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        packed = f.read(info.compress_size)
    if len(packed) != info.compress_size:
        raise CaptureFileError(f"{path}: truncated capture ({name} is short)")
    stored = info.compress_type == zipfile.ZIP_STORED
    pieces = _stored(packed, info.file_size) if stored else inflate(packed, info.file_size, path, name)
    crc, size = 0, 0
    for piece in pieces:
        crc = crc32(piece, crc)
        size += len(piece)
        yield piece
    if size != info.file_size:
        raise CaptureFileError(f"{path}: truncated capture ({name} is short)")
    if crc != info.CRC:
        raise CaptureFileError(f"{path}: corrupt capture ({name} fails its CRC check)")


def read_ahead(pieces: Iterator[bytes], depth: int = 2) -> Iterator[bytes]:
    """`pieces` made on a thread of their own, at most `depth` ahead of the reader: inflating and the
    CRC (which let go of the GIL) run beside what the reader does with the pieces before, on a second
    core. What the maker raises (a corrupt member) is raised to the reader after the pieces before
    it; a reader that stops early stops the maker."""
    ready: queue.Queue[tuple[bytes | None, BaseException | None]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple[bytes | None, BaseException | None]) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def make() -> None:
        try:
            for piece in pieces:
                if not put((piece, None)):
                    return
            put((None, None))
        except BaseException as exc:  # (handed to the reader, which raises it)
            put((None, exc))

    maker = threading.Thread(target=make, name="memprof-inflate", daemon=True)
    maker.start()
    try:
        while True:
            piece, error = ready.get()
            if error is not None:
                raise error
            if piece is None:
                return
            yield piece
    finally:
        stop.set()
        maker.join()


def _stored(packed: bytes, size: int) -> Iterator[bytes]:
    view = memoryview(packed)[:size]
    for at in range(0, len(view), _PIECE):
        yield bytes(view[at : at + _PIECE])


def inflate(packed: bytes, size: int, path: Path, name: str) -> Iterator[bytes]:
    """A deflated member's bytes, a megabyte of the stream in and at most 4 MB out at a time: never
    more than its declared size (a stream that would inflate further is refused there), and no
    copy of the whole (zipfile's reader copies every piece through Python's buffers; one
    `decompress` call joins its output blocks at the end and runs out of the cache)."""
    stream_of = decompressor()  # (raw deflate, as a zip member holds it)
    stream, at, pos = memoryview(packed), 0, 0
    pending: bytes | memoryview = b""
    while not stream_of.eof:
        if not pending and pos < len(stream):
            pending, pos = stream[pos : pos + (1 << 20)], pos + (1 << 20)
        try:
            piece = stream_of.decompress(pending, min(size - at + 1, _PIECE))
        except ERRORS:
            raise CaptureFileError(f"{path}: corrupt capture ({name} is not a valid deflate stream)") from None
        pending = stream_of.unconsumed_tail
        if at + len(piece) > size or not (piece or pending or pos < len(stream)):
            break  # (past the declared size, or nothing more to come: a stream cut short)
        at += len(piece)
        if piece:
            yield piece
    if not stream_of.eof or at != size or pending:
        raise CaptureFileError(f"{path}: corrupt capture ({name} inflates to other than its declared size)")
