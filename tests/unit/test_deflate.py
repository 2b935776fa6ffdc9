"""The events' deflate stream made while a capture runs (`memprof.deflate`): its CRC joins the header's
as zlib's `crc32_combine` does, and the member it makes reads back through zipfile's own reader (its
size and CRC checked) as the header followed by every byte fed, in order."""

from __future__ import annotations

import io
import zipfile
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from memprof.deflate import Deflated, StreamDeflater, crc32_combine, write_deflated


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=3000))
def test_crc32_combine_equals_the_crc_of_the_joined_bytes(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.lists(st.binary(max_size=70_000), max_size=6), st.binary(max_size=500))
def test_a_member_of_a_header_and_a_stream_deflated_before_reads_back_whole(
        head: bytes, pieces: list[bytes], last: bytes) -> None:
    stream = StreamDeflater()
    packed = [stream.feed(p) for p in pieces]
    packed.append(stream.end(last))
    assert stream.end(last) == packed[-1]  # (a second end gives the same bytes)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("events.npy", "w", force_zip64=True) as member:
            assert write_deflated(member, head, Deflated(packed, stream.crc, stream.size))
        zf.writestr("after.json", "{}")
    with zipfile.ZipFile(buf) as zf:
        assert zf.testzip() is None  # (every member's CRC)
        assert zf.read("events.npy") == head + b"".join(pieces) + last
        assert zf.getinfo("events.npy").file_size == len(head) + stream.size


def test_a_member_writer_it_does_not_know_is_left_to_the_caller() -> None:
    out = io.BytesIO()
    assert not write_deflated(out, b"head", Deflated([b""], 0, 0))
    assert out.getvalue() == b""
