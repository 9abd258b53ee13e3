"""Zero-copy byte views of the buffers callers hand the pool (numpy arrays, memoryviews, bytes)."""

from __future__ import annotations

from typing import Any

import numpy as np


def as_u8(buf: Any, writable: bool = False) -> np.ndarray:
    """View ``buf`` as a 1-D uint8 array without copying; raises ValueError/TypeError if impossible."""
    if isinstance(buf, np.ndarray) and buf.ndim == 1 and buf.dtype == np.uint8:
        arr = buf
    else:
        view = memoryview(buf)
        if not view.c_contiguous:
            raise ValueError("buffer is not contiguous")
        arr = np.frombuffer(view.cast("B"), dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("buffer is not contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("buffer is read-only")
    return arr
