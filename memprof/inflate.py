"""A zip member read whole, fast and bounded (`memprof.fileformat`'s events): its bytes found from
its local header, inflated straight into one buffer of its declared size and never past it, and
checked against its CRC."""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from memprof.errors import CaptureFileError


def member_data(path: Path, info: zipfile.ZipInfo, name: str) -> bytes | np.ndarray:
    """A member's bytes (`inflate`d where deflated), checked against its CRC; `name`: the member's,
    as an error line shows it."""
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
    data: bytes | np.ndarray = packed if stored else inflate(packed, info.file_size, path, name)
    del packed
    if zlib.crc32(data if isinstance(data, bytes) else data.data) != info.CRC:
        raise CaptureFileError(f"{path}: corrupt capture ({name} fails its CRC check)")
    return data


def inflate(packed: bytes, size: int, path: Path, name: str) -> np.ndarray:
    """A deflated member's bytes, inflated into one buffer of its declared size, a megabyte of the
    stream in and at most 4 MB out at a time: never more than that size (a stream that would
    inflate further is refused there), and no second copy of the whole (zipfile's reader copies
    every piece through Python's buffers; one `decompress` call joins its output blocks at the
    end and runs out of the cache)."""
    out = np.empty(size, dtype=np.uint8)
    stream_of = zlib.decompressobj(-15)  # (raw deflate, as a zip member holds it)
    stream, at, pos = memoryview(packed), 0, 0
    pending: bytes | memoryview = b""
    while not stream_of.eof:
        if not pending:
            if pos >= len(stream):
                break
            pending, pos = stream[pos : pos + (1 << 20)], pos + (1 << 20)
        piece = stream_of.decompress(pending, min(size - at + 1, 4 << 20))  # (pieces that stay in the cache)
        pending = stream_of.unconsumed_tail
        if at + len(piece) > size:
            break
        out[at : at + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        at += len(piece)
    if not stream_of.eof or at != size or pending:
        raise CaptureFileError(f"{path}: corrupt capture ({name} inflates to other than its declared size)")
    return out
