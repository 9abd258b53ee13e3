"""Key normalization for stores that restrict keys (openYuanrong datasystem).

A key the store accepts as it is (only characters of the allowed set, at most `max_len`
characters) passes unchanged, so it can be read in the store's own tools. Any other key is
rewritten: its characters outside the set become `_`, it is cut to fit, and `%%` plus 32 hex
digits of its SHA-256 are appended. Rewritten keys always contain `%%` and unchanged ones
never do (a key containing `%%` is rewritten too), and the prefix of a rewritten key never
contains `%`, so the two sets cannot meet; two rewritten keys meet only if their SHA-256
prefixes (128 bits) collide.
"""

from __future__ import annotations

import hashlib
import re

# openyuanrong-datasystem 0.8's rule, from its error message: ^[a-zA-Z0-9\-_!@#%\^\*\(\)\+\=\:;]*$
# and at most 255 characters. (The spec says 1024 for the release it was written against.)
YUANRONG_ALLOWED = r"a-zA-Z0-9\-_!@#%^*()+=:;"
YUANRONG_MAX_LEN = 255
MARKER = "%%"
DIGEST_HEX = 32


class KeyNormalizer:
    """Maps arbitrary keys to keys a store accepts, injectively (see the module docstring)."""

    def __init__(self, allowed: str = YUANRONG_ALLOWED, max_len: int = YUANRONG_MAX_LEN) -> None:
        if max_len < len(MARKER) + DIGEST_HEX + 1:
            raise ValueError(f"max_len={max_len} leaves no room for the hash suffix")
        self.max_len = max_len
        self._ok = re.compile(f"^[{allowed}]*$")
        # Everything outside the set, and '%' itself, is replaced in a rewritten key's prefix.
        self._bad = re.compile(f"[^{allowed}]|%")

    def accepts(self, key: str) -> bool:
        """Whether the store would take `key` as it is (and kvpool passes it unchanged)."""
        return len(key) <= self.max_len and bool(self._ok.match(key)) and MARKER not in key

    def __call__(self, key: str) -> str:
        if self.accepts(key):
            return key
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_HEX]
        prefix = self._bad.sub("_", key)[: self.max_len - len(MARKER) - DIGEST_HEX]
        return prefix + MARKER + digest


normalize_yuanrong_key = KeyNormalizer()
