"""The chaos run's tools without vLLM (kvpool.testing.chaos): the slow-store proxy passes the
pool's trust checks and forwards bytes unchanged, and slows the store while its flag is set;
the rogue client's corruption of the arena is a CHECKSUM_MISMATCH for readers, never wrong
bytes with OK; a writer SIGKILLed mid-put leaves the server serving; the summary's
accounting of requests during and outside faults."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvpool.errors import ErrorCode
from kvpool.testing.chaos import _ROGUE, _WRITER, ChaosConfig, ChaosResult, Fault, ProxyProcess, Request, config_record

OK = int(ErrorCode.OK)


def _proxy(sock_path: str, sock_dir: str) -> tuple[ProxyProcess, str]:
    flag = os.path.join(sock_dir, "slow.flag")
    proxy = ProxyProcess(os.path.join(sock_dir, "proxy.sock"), sock_path, flag, (0.3, 0.4),
                         log_path=os.path.join(sock_dir, "proxy.log"))
    return proxy.start(), flag


def test_proxy_forwards_and_slows(start_server, make_client, sock_path, sock_dir):
    start_server()
    proxy, flag = _proxy(sock_path, sock_dir)
    try:
        c = make_client(proxy.listen, timeout_s=0.2)
        assert c.wait_connected(5) and c.untrusted == 0  # SO_PEERCRED and the arena's owner pass
        value = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
        assert c.put(["k"], [[value]]) == [OK]
        out = np.zeros_like(value)
        assert c.get_into(["k"], [[out]]) == [OK] and np.array_equal(out, value)
        Path(flag).touch()  # every chunk now waits longer than the client's 0.2 s round trip
        assert c.exists(["k"]) == [False]
        os.unlink(flag)
        assert c.wait_connected(5) and c.exists(["k"]) == [True]
    finally:
        proxy.stop()


def test_rogue_corruption_is_a_checksum_miss(start_server, make_client, sock_path):
    start_server()  # 16MB
    c = make_client()
    assert c.wait_connected(5)
    value = np.random.default_rng(0).integers(0, 256, size=6 << 20, dtype=np.uint8)  # within the 50 % share
    assert c.put(["big"], [[value]]) == [OK]
    r = subprocess.run([sys.executable, "-c", _ROGUE, sock_path, "256", "4096", "1"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and int(r.stdout.strip()) > 0, r.stderr
    out = np.zeros_like(value)
    assert c.get_into(["big"], [[out]]) == [int(ErrorCode.CHECKSUM_MISMATCH)]


def test_writer_killed_mid_put_leaves_the_server_serving(start_server, make_client, sock_path):
    server = start_server()
    w = subprocess.Popen([sys.executable, "-c", _WRITER, sock_path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert w.stdout is not None and b"writing" in w.stdout.readline()
    time.sleep(0.3)
    w.kill()
    w.wait(10)
    c = make_client()
    assert c.wait_connected(5)
    value = np.ones(1 << 20, dtype=np.uint8)
    assert c.put(["after"], [[value]]) == [OK]
    out = np.zeros_like(value)
    assert c.get_into(["after"], [[out]]) == [OK] and np.array_equal(out, value)
    assert server.alive()


def test_summary_splits_requests_by_fault_windows():
    reqs = [
        Request(0.0, 1.0, "A", 0, "load", "ok", ttft_s=0.5, cached_tokens=0, prompt_tokens=100),  # cold, outside
        Request(2.0, 3.0, "B", 0, "load", "ok", ttft_s=0.1, cached_tokens=80, prompt_tokens=100),  # during
        Request(6.0, 7.0, "A", 1, "load", "failed"),
        Request(8.0, 9.0, "B", 1, "final", "ok", ttft_s=0.1, cached_tokens=50, prompt_tokens=100),
    ]
    res = ChaosResult({"lookup_timeout_s": 0.3, "transfer_timeout_s": 1.0}, reqs, [Fault("kill", 2.5, 4.0)], {}, {},
                      7.0)
    s = res.summary()
    assert (s["ok"], s["failed"], s["wrong"], s["hung"]) == (3, 1, 0, 0)
    assert s["ttft_during_faults"]["n"] == 1 and s["ttft_outside_faults"]["n"] == 1 and s["ttft_cold"]["n"] == 1
    assert s["hit_rate"] == 0.4 and s["final_requests_with_hits"] == 1 and s["faults_by_kind"]["kill"] == 1
    assert s["target_met"] is True


def test_the_results_record_a_run_whose_log_holds_a_lock() -> None:
    """benchmarks/chaos.py logs through its progress bar, whose method holds a lock: the run's
    settings go into its results without copying the callback (a deep copy raised at the end of
    every benchmark run)."""
    import json
    import threading

    class Bar:
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def log(self, msg: str) -> None:
            with self.lock:
                pass

    record = config_record(ChaosConfig(model_dir="/m", duration_s=90.0, log=Bar().log))
    assert "log" not in record and record["duration_s"] == 90.0 and record["model_dir"] == "/m"
    json.dumps(record)
