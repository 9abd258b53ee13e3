"""The rules for a directory that will hold pooled KV on disk (the SSD tier's `ssd_offload_path`,
Mooncake's offload path): checked once, at start-up, by the config, the engine and `kvpool doctor`."""

from __future__ import annotations

import os
import tempfile

from kvpool.errors import ConfigError

def validate_offload_path(path: str) -> None:
    """Check the SSD offload directory, raising ``ConfigError`` naming what to fix.

    Rules: absolute, no ``..`` component, no symlink anywhere in it (the resolved
    path must equal the written one, so the pool can never be redirected
    elsewhere by a link), exists, is a directory, writable.
    """

    def fail(expected: str) -> None:
        raise ConfigError(key="ssd_offload_path", value=path, expected=expected)

    if not isinstance(path, str) or not path:
        fail("a non-empty absolute directory path, e.g. /mnt/nvme/kvpool")
    if not os.path.isabs(path):
        fail("an absolute path (starting with '/'), e.g. /mnt/nvme/kvpool")
    if ".." in path.split("/"):
        fail("a path without '..' components; write the resolved directory instead")
    normalized = os.path.normpath(path)
    if os.path.realpath(path) != normalized:
        fail(
            f"a path without symlinks (it resolves to {os.path.realpath(path)!r}); "
            f"use the resolved path"
        )
    if not os.path.exists(path):
        fail("an existing directory; create it first (mkdir -p) with the serving user as owner")
    if not os.path.isdir(path):
        fail("a directory, not a file")
    # A real write, not os.access: root passes every mode check but still cannot write to a
    # read-only mount, and that is what would fail later, mid-serving.
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvpool-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        fail(f"a directory writable by the serving user ({exc.strerror}); fix its owner, mode or mount")
