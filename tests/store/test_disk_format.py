"""The SSD tier's formats as bytes: an index reads back as written, and a damaged one never reads
as a different index; a file header is judged by its fields."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.store.disk_format import (
    HEADER_SIZE,
    checksum_problem,
    decode_index,
    encode_index,
    file_problem,
    pack_header,
    unpack_header,
)

entries = st.lists(st.tuples(st.text(min_size=1, max_size=40), st.integers(0, 2**63 - 1)), max_size=20)
shard_times = st.dictionaries(st.text("0123456789abcdef", min_size=2, max_size=2), st.integers(-2**62, 2**62),
                              max_size=8)


@settings(max_examples=200, deadline=None)
@given(entries, shard_times)
def test_an_index_reads_back_as_written(items, times):
    assert decode_index(encode_index(items, times)) == (times, items)


@settings(max_examples=200, deadline=None)
@given(entries, shard_times, st.data())
def test_a_damaged_index_is_refused_never_misread(items, times, data):
    blob = bytearray(encode_index(items, times))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises((ValueError, struct.error, UnicodeDecodeError)):
        decode_index(bytes(blob))
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises((ValueError, struct.error, UnicodeDecodeError)):
        decode_index(bytes(encode_index(items, times))[:cut])


def test_a_header_is_judged_by_its_fields():
    payload = b"x" * 10
    digest = checksum_problem(unpack_header(pack_header(1, 10, 0)), payload)[0]
    head = unpack_header(pack_header(1, len(payload), digest))
    assert file_problem(head, b"k", len(payload), False, "k") is None
    assert checksum_problem(head, payload) == (digest, None)
    assert checksum_problem(head, b"y" * 10)[1] == "checksum mismatch"
    assert unpack_header(pack_header(1, 10, digest)[:HEADER_SIZE - 1]) is None
    assert file_problem(None, b"", 0, False, "k") == "truncated header"
    assert file_problem(head, b"k", 9, False, "k") == "payload has 9 of 10 bytes (truncated)"
    assert file_problem(head, b"k", 10, True, "k") == "trailing bytes after the payload"
    assert file_problem(head, b"j", 10, False, "k") == "stored key differs from the requested key"
    assert file_problem((b"NOPE",) + head[1:], b"k", 10, False, "k").startswith("bad magic/version")
