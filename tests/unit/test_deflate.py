"""The events' deflate stream made while a capture runs (`memprof.deflate`): its CRC joins the header's
as zlib's `crc32_combine` does, and the member it makes reads back through zipfile's own reader (its
size and CRC checked) and memprof's (`memprof.inflate`) as the header followed by every byte fed, in
order: made and read by ISA-L (where installed) or zlib, in every pairing."""

from __future__ import annotations

import contextlib
import io
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memprof.deflate
from memprof.deflate import Deflated, StreamDeflater, crc32_combine, write_deflated
from memprof.errors import CaptureFileError
from memprof.inflate import inflate, member_pieces, read_ahead

BACKENDS = ["isal", "zlib"] if memprof.deflate._isal is not None else ["zlib"]


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """memprof's deflate and inflate by `name`: ISA-L's (the installed default) or zlib's fallback."""
    saved = memprof.deflate._isal
    memprof.deflate._isal = saved if name == "isal" else None  # type: ignore[assignment]
    try:
        yield
    finally:
        memprof.deflate._isal = saved  # type: ignore[assignment]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=3000))
def test_crc32_combine_equals_the_crc_of_the_joined_bytes(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.lists(st.binary(max_size=70_000), max_size=6), st.binary(max_size=500))
def test_a_member_of_a_header_and_a_stream_deflated_before_reads_back_whole(
        head: bytes, pieces: list[bytes], last: bytes) -> None:
    whole = head + b"".join(pieces) + last
    for made, read in [(m, r) for m in BACKENDS for r in BACKENDS]:
        with backend(made):
            stream = StreamDeflater()
            packed = [stream.feed(p) for p in pieces]
            packed.append(stream.end(last))
            assert stream.end(last) == packed[-1]  # (a second end gives the same bytes)
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
                with zf.open("events.npy", "w", force_zip64=True) as member:
                    assert write_deflated(member, head, packed, Deflated(packed, stream.crc, stream.size))
                zf.writestr("after.json", "{}")
        with zipfile.ZipFile(buf) as zf:
            assert zf.testzip() is None  # (every member's CRC)
            assert zf.read("events.npy") == whole
            info = zf.getinfo("events.npy")
            assert info.file_size == len(head) + stream.size
        with tempfile.TemporaryDirectory() as d, backend(read):  # (memprof's reader: its size and CRC checked)
            path = Path(d) / "c.memprof"
            path.write_bytes(buf.getvalue())
            assert b"".join(member_pieces(path, info, "events.npy")) == whole


@pytest.mark.parametrize("name", BACKENDS)
def test_a_stream_cut_short_longer_than_declared_or_not_deflate_is_refused(name: str) -> None:
    data = bytes(range(256)) * 5000
    with backend(name):
        stream = StreamDeflater()
        packed = stream.feed(data) + stream.end()
        for cut, size in [(packed[: len(packed) // 2], len(data)), (packed, len(data) - 1), (packed, len(data) + 1)]:
            with pytest.raises(CaptureFileError, match="inflates to other than its declared size"):
                b"".join(inflate(cut, size, Path("x"), "events.npy"))
        garbage = bytes([0xFF] * 64) + packed  # (a block type deflate does not have)
        with pytest.raises(CaptureFileError, match="is not a valid deflate stream"):
            b"".join(inflate(garbage, len(data), Path("x"), "events.npy"))


def test_pieces_read_ahead_come_in_order_with_the_makers_error_after_them_and_an_early_stop_ends_it() -> None:
    """The events are read while a thread of their own inflates the next pieces (`read_ahead`)."""
    import threading

    made: list[int] = []

    def pieces(n: int, fail_at: int | None = None) -> Iterator[bytes]:
        for i in range(n):
            if i == fail_at:
                raise CaptureFileError("x: corrupt capture (events.npy fails its CRC check)")
            made.append(i)
            yield bytes([i]) * 3

    assert list(read_ahead(pieces(50), depth=2)) == list(pieces(50))
    got: list[bytes] = []
    with pytest.raises(CaptureFileError, match="fails its CRC check"):
        for piece in read_ahead(pieces(10, fail_at=7)):
            got.append(piece)
    assert got == [bytes([i]) * 3 for i in range(7)]  # (every piece before the error, then the error)
    made.clear()
    reader = read_ahead(pieces(1000), depth=2)
    assert next(reader) == b"\x00" * 3
    reader.close()  # (the reader stops: the maker stops, a few pieces ahead at most)
    assert len(made) <= 4 and not any(t.name == "memprof-inflate" for t in threading.enumerate())


def test_a_member_writer_it_does_not_know_is_left_to_the_caller() -> None:
    out = io.BytesIO()
    assert not write_deflated(out, b"head", [b""], Deflated([b""], 0, 0))
    assert out.getvalue() == b""
