"""Stores whose own clients can write any key (Redis, Mooncake Store, the openYuanrong
datasystem): bytes kvpool did not store under a key are never read back under it with success,
whoever wrote them. Each case fails on a store without key-bound checksums."""

from __future__ import annotations

import numpy as np

from conformance_helpers import empty_like_segments, payload
from kvpool.errors import ErrorCode

OK = ErrorCode.OK
SIZE = 64 << 10


def test_another_keys_object_copied_under_a_key_is_not_served(writable_backend_factory):
    # The attack: `SET dst <src's object>`, over a key kvpool stored and under a key it never did.
    make = writable_backend_factory
    b = make(make.capacity(4 << 20))
    assert b.batch_put(["src", "dst"], [[payload("src", SIZE)], [payload("dst", SIZE)]]) == [OK, OK]
    for key in ("dst", "fresh"):
        make.copy_raw(b, "src", key)
        out = empty_like_segments([SIZE])
        assert b.batch_get_into([key], [out]) == [ErrorCode.CHECKSUM_MISMATCH], key
    assert b.stats()["corrupt_reads"] == 2
    src = empty_like_segments([SIZE])
    assert b.batch_get_into(["src"], [src]) == [OK] and np.array_equal(src[0], payload("src", SIZE))


def test_bytes_another_client_wrote_under_a_key_are_not_served(writable_backend_factory):
    make = writable_backend_factory
    b = make(make.capacity(4 << 20))
    forged = payload("forged", SIZE + 64).tobytes()
    for n in (SIZE, SIZE + 16, SIZE + 40):  # the value's size, and with room for any header or seal
        key = f"k{n}"
        make.write_raw(b, key, forged[:n])
        out = empty_like_segments([SIZE])
        code = b.batch_get_into([key], [out])[0]
        assert code != OK, (key, code)
