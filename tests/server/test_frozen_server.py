"""A `kvpool server` frozen with SIGSTOP under a guarded client (`backends.guard`): the first
call costs one deadline, later calls cost nothing, and hits come back once it thaws."""

from __future__ import annotations

import numpy as np

from kvpool.backends.guard import GuardSettings
from kvpool.backends.pool_server import ServerBackend
from kvpool.errors import OK, RPC_TIMEOUT
from kvpool.testing.proc import wait_for

FAST = GuardSettings(lookup_timeout_s=0.05, transfer_timeout_s=0.1, failures=3, cooldown_s=0.05,
                     cooldown_max_s=0.2)


def test_frozen_server_costs_one_deadline_then_nothing(start_server, sock_path):
    server = start_server()
    b = ServerBackend(sock_path, "guarded")
    b.use_guard(FAST)
    try:
        assert wait_for(lambda: b.client.connected, 10)
        value = np.arange(4096, dtype=np.uint8)
        assert b.batch_put(["a"], [[value]]) == [OK]
        server.pause()
        try:
            dest = np.zeros(4096, np.uint8)
            assert b.batch_get_into(["a"], [[dest]]) == [RPC_TIMEOUT]
            assert b.stats()["timeouts"] == 1
            for _ in range(20):  # every later call is answered without the server
                assert b.batch_exists(["a"]) == [False]
            assert b.stats()["timeouts"] == 1
        finally:
            server.resume()
        assert wait_for(lambda: b.batch_exists(["a"]) == [True], 30)
        assert b.batch_get_into(["a"], [[dest]]) == [OK] and np.array_equal(dest, value)
    finally:
        b.close()
