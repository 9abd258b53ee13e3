"""`kvpool server` and `backend: server`: start-up, flags, data path, shutdown, stats."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import pytest
from srvutil import arena_files, payload, payload_ok

import kvpool

from kvpool.backends import create_backend
from kvpool.cli import stats as stats_cli
from kvpool.config import DEFAULT_SERVER_SOCKET, load_config
from kvpool.errors import ConfigError, ErrorCode
from kvpool.metrics import catalog
from kvpool.server import protocol as P
from kvpool.server import shm
from kvpool.config import ServerSettings
from kvpool.server.daemon import add_arguments, config_from_args
from kvpool.testing.metrics import families, scrape_problems, value
from kvpool.testing.proc import signal_thread, threads, wait_for

OK = 0


def parse_flags(*argv: str) -> ServerSettings:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


# ---- start-up, files, shutdown -------------------------------------------------------------


def test_starts_fast_with_private_files_and_cleans_up_on_sigterm(start_server, make_client, sock_path):
    server = start_server()
    # The spec asks for under a second; the bound is looser so a loaded CI box does not flake.
    assert server.startup_s < 2.0, server.startup_s
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    [name] = arena_files(sock_path)
    arena_path = os.path.join(shm.SHM_DIR, name)
    assert stat.S_IMODE(os.stat(arena_path).st_mode) == 0o600
    assert os.path.getsize(arena_path) == 16 << 20

    client = make_client(name="vllm-dp0-tp0-pp0")
    assert client.connected
    assert client.server_info.arena_name == name and client.server_info.server_pid == server.pid
    client.close()
    assert wait_for(lambda: "client disconnected: vllm-dp0-tp0-pp0" in server.log(), 5)
    assert server.log().count("client connected: vllm-dp0-tp0-pp0") == 1

    assert server.stop() == 0
    assert not os.path.exists(sock_path)
    assert not os.path.exists(sock_path + ".lock")
    assert arena_files(sock_path) == []
    assert "kvpool server stopped" in server.log()


def test_kvpool_server_subcommand(start_server, make_client):
    server = start_server("--memory_size", "2MB", entry=("-m", "kvpool.cli", "server"))
    assert make_client().server_info.arena_size == 2 << 20
    server.send_signal(signal.SIGINT)  # Ctrl-C takes the same clean path as SIGTERM
    assert server.wait() == 0 and "received SIGINT" in server.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_taken_by_another_thread_still_stops_the_server(start_server, make_client, sock_path, sig):
    """The kernel hands a process-directed signal to any thread that does not block it; Python
    runs the handler on the main thread, which sleeps in select() and would never wake up (the
    server then had to be SIGKILLed, leaving its arena, socket and lock behind)."""
    server = start_server()
    client = make_client()
    assert client.ping() == OK  # its connection has a thread of its own, waiting in recv()
    main, *others = threads(server.pid)
    assert main == server.pid and others
    signal_thread(server.pid, others[-1], sig)
    assert server.wait(timeout_s=10) == 0
    assert f"received {signal.Signals(sig).name}" in server.log() and "kvpool server stopped" in server.log()
    assert not os.path.exists(sock_path) and not os.path.exists(sock_path + ".lock")
    assert arena_files(sock_path) == []


def test_a_connection_without_a_thread_does_not_stop_the_server(sock_path, make_client, monkeypatch):
    # One thread per connection: out of threads (a container's pids limit, RLIMIT_NPROC) the
    # new connection must be turned away as an accept() EMFILE is, not end serve_forever() for all.
    from kvpool.server.daemon import Server

    server = Server(parse_flags("--socket", sock_path, "--memory-size", "4MB"))
    server.start()
    serving = threading.Thread(target=server.serve_forever, name="test-serve", daemon=True)
    serving.start()
    try:
        first = make_client(name="first", ping=False)
        assert first.ping() == OK
        start = threading.Thread.start
        refused: list[str] = []

        def no_thread_for_the_next_connection(self: threading.Thread) -> None:
            if self.name.startswith("kvpool-conn-") and not refused:
                refused.append(self.name)
                raise RuntimeError("can't start new thread")
            start(self)

        monkeypatch.setattr(threading.Thread, "start", no_thread_for_the_next_connection)
        unlucky = make_client(name="unlucky", ping=False, connect_timeout_s=2.0)
        assert refused and not unlucky.connected
        assert serving.is_alive()
        assert first.ping() == OK  # the connections it had are still served
        assert unlucky.wait_connected(5) and unlucky.ping() == OK  # and new ones once threads are back
        assert server.stats()["connected_clients"] == 2
    finally:
        server.stop()
        serving.join(10)
        left = arena_files(sock_path)
        for name in left:  # a failed shutdown must not leave its arena in /dev/shm
            shm.unlink(name)
    assert not serving.is_alive() and left == []


def test_socket_mode_widens_the_socket_only(start_server, sock_path):
    start_server("--socket-mode", "0660")
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o660
    [name] = arena_files(sock_path)
    assert stat.S_IMODE(os.stat(os.path.join(shm.SHM_DIR, name)).st_mode) == 0o600  # whoever maps: --allowed_gid


def test_allowed_gid_shares_socket_and_arena_with_the_group(start_server, make_client, sock_path):
    gid = os.getgid()
    start_server("--allowed_gid", str(gid))
    st = os.stat(sock_path)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, gid)
    [name] = arena_files(sock_path)
    st = os.stat(os.path.join(shm.SHM_DIR, name))
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, gid)
    assert make_client(allowed_gid=gid).ping() == OK
    # A client that did not opt into group sharing never puts its KV where the group can read it.
    private = make_client(ping=False)
    assert private.ping() == ErrorCode.RPC_FAIL and private.untrusted == 1 and private.arena is None


def test_second_server_on_a_live_socket_exits_with_a_clear_error(start_server, make_client):
    first = start_server()
    second = start_server(expect_ready=False)
    assert second.wait() == 1
    assert f"another kvpool server (pid {first.pid}) is serving on" in second.log()
    assert first.alive() and make_client().ping() == OK


def test_stale_socket_and_arena_of_a_killed_server_are_taken_over(start_server, make_client, sock_path):
    first = start_server()
    old = arena_files(sock_path)
    first.kill()
    assert os.path.exists(sock_path) and arena_files(sock_path) == old  # what SIGKILL leaves behind
    second = start_server()
    assert "took over stale socket" in second.log()
    assert arena_files(sock_path) == shm.arena_names(sock_path, second.pid) and len(arena_files(sock_path)) == 1
    assert make_client().ping() == OK


@pytest.mark.parametrize("bad", [
    ["--memory-size", "12XB"],
    ["--eviction_ratio", "0"],
    ["--socket-mode", "0644x"],
    ["--enable_offload"],
    ["--default_kv_lease_ttl", "0"],
    ["--memory-size", "1KB"],
    ["--memory-size", "100TB"],  # more than /dev/shm holds: refused, not a SIGBUS later
    ["--socket", "/nonexistent-dir/kvpool.sock"],
])
def test_bad_flags_stop_start_up_naming_the_flag(start_server, bad):
    server = start_server(*bad, expect_ready=False)
    assert server.wait() == 2
    assert "kvpool server: error: [INVALID_PARAMS -600]" in server.log()


def test_metrics_port_in_use_is_a_clear_error(start_server, sock_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = start_server("--metrics_port", str(taken.getsockname()[1]), expect_ready=False)
        assert server.wait() == 2
    assert "metrics_port=" in server.log() and "a free TCP port on 127.0.0.1" in server.log()
    assert not os.path.exists(sock_path) and arena_files(sock_path) == []  # nothing left behind


def test_flags_in_spec_spelling_and_with_dashes(tmp_path):
    spec = parse_flags("--global_segment_size", "1GB", "--eviction_high_watermark_ratio", "0.8",
                       "--eviction_ratio", "0.2", "--default_kv_lease_ttl", "7000", "--client_ttl", "3",
                       "--metrics_port", "0", "--socket", "/tmp/x.sock")
    dashed = parse_flags("--memory-size", "1GB", "--eviction-high-watermark-ratio", "0.8",
                         "--eviction-ratio", "0.2", "--default-kv-lease-ttl", "7000", "--client-ttl", "3",
                         "--metrics-port", "0", "--socket", "/tmp/x.sock")
    assert spec == dashed
    assert (spec.memory_size, spec.eviction_high_watermark_ratio, spec.eviction_ratio) == (1 << 30, 0.8, 0.2)
    assert (spec.default_kv_lease_ttl_ms, spec.client_ttl_s, spec.metrics_port) == (7000, 3.0, 0)
    ssd = os.path.realpath(tmp_path)
    off = parse_flags("--enable_offload", "--offload-path", ssd, "--offload-quota", "2GB",
                      "--offload-eviction-policy", "fifo")
    assert (off.offload_path, off.offload_quota, off.offload_eviction_policy) == (ssd, 2 << 30, "fifo")
    assert parse_flags().socket_path == DEFAULT_SERVER_SOCKET == load_config({"backend": "server"}).backend_settings.server_socket
    with pytest.raises(ConfigError, match="--offload-path"):
        parse_flags("--enable_offload", "--offload-path", "relative/dir")


# ---- data path ---------------------------------------------------------------------------------


def test_put_get_exists_through_the_shared_arena(start_server, make_client):
    start_server()
    writer, reader = make_client(name="writer"), make_client(name="reader")
    keys = [f"key{i}" for i in range(20)]
    data = {k: payload(k, 1000 + 37 * i) for i, k in enumerate(keys)}
    # Several segments per value, as vLLM passes one view per layer.
    values = [[data[k][:100], data[k][100:555], data[k][555:]] for k in keys]
    assert writer.put(keys, values) == [OK] * 20
    # An existing key: nothing written, and the answer says so (the server's put-if-absent).
    assert writer.put(keys[:2], values[:2]) == [int(ErrorCode.OBJECT_ALREADY_EXISTS)] * 2
    assert reader.exists(keys + ["absent"], lease=True) == [True] * 20 + [False]
    outs = {k: np.zeros(data[k].size, np.uint8) for k in keys}
    codes = reader.get_into(keys + ["absent"], [[outs[k][:10], outs[k][10:]] for k in keys]
                            + [[np.zeros(10, np.uint8)]])
    assert codes == [OK] * 20 + [int(ErrorCode.OBJECT_NOT_FOUND)]
    assert all(np.array_equal(outs[k], data[k]) for k in keys)


def test_the_arena_lives_where_kvpool_shm_dir_says(sock_path, sock_dir, make_client, monkeypatch):
    # In containers the pool's directory is mounted away from each container's own /dev/shm:
    # server and client both find the arena there, and none appears in /dev/shm.
    from kvpool.testing.launch import PoolServer

    shm_dir = tempfile.mkdtemp(prefix="kvtest-", dir="/dev/shm")
    server = PoolServer(sock_path, memory_size="8MB", env={"KVPOOL_SHM_DIR": shm_dir},
                        log_path=os.path.join(sock_dir, "server.log"), startup_timeout_s=15.0)
    try:
        server.start()
        assert arena_files(sock_path) == []  # not in /dev/shm
        monkeypatch.setattr(shm, "SHM_DIR", shm_dir)  # what the client's KVPOOL_SHM_DIR says
        [name] = arena_files(sock_path)
        assert stat.S_IMODE(os.stat(os.path.join(shm_dir, name)).st_mode) == 0o600
        client = make_client()
        assert client.put(["k"], [[payload("k", 3000)]]) == [OK]
        out = np.zeros(3000, np.uint8)
        assert client.get_into(["k"], [[out]]) == [OK] and payload_ok("k", out)
        client.close()
        assert server.stop() == 0
        assert arena_files(sock_path) == []
    finally:
        server.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_one_client_shared_by_threads(start_server, make_client):
    import threading

    start_server()
    client = make_client()
    errors: list[str] = []

    def work(t: int) -> None:
        for i in range(40):
            keys = [f"t{t}-{i}-{j}" for j in range(4)]
            if client.put(keys, [[payload(k, 3000)] for k in keys]) != [OK] * 4:
                errors.append(f"put {keys}")
            outs = [np.zeros(3000, np.uint8) for _ in keys]
            if client.get_into(keys, [[o] for o in outs]) != [OK] * 4 or not all(
                payload_ok(k, o) for k, o in zip(keys, outs)
            ):
                errors.append(f"get {keys}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_edge_values_and_bad_arguments(start_server, make_client):
    start_server("--memory-size", "8MB")
    c = make_client()
    big = payload("big", 3 << 20)
    assert c.put(["empty", "big"], [[np.zeros(0, np.uint8)], [big]]) == [OK, OK]
    out = np.zeros(3 << 20, np.uint8)
    assert c.get_into(["empty", "big"], [[np.zeros(0, np.uint8)], [out]]) == [OK, OK]
    assert payload_ok("big", out)
    # sizes that do not add up, a key too long, an empty key, mismatched lists
    assert c.get_into(["big"], [[np.zeros(10, np.uint8)]]) == [int(ErrorCode.INVALID_PARAMS)]
    long_key = "x" * (P.MAX_KEY_BYTES + 1)
    assert c.put([long_key, ""], [[big[:10]], [big[:10]]]) == [int(ErrorCode.INVALID_KEY)] * 2
    assert c.exists([long_key, "", "big"]) == [False, False, True]
    assert c.put(["a", "b"], [[big[:10]]]) == [int(ErrorCode.INVALID_PARAMS)] * 2
    # read-only destination
    ro = np.zeros(3 << 20, np.uint8)
    ro.flags.writeable = False
    assert c.get_into(["big"], [[ro]]) == [int(ErrorCode.INVALID_PARAMS)]
    # a value larger than the whole pool
    assert c.put(["huge"], [[np.zeros(9 << 20, np.uint8)]]) == [int(ErrorCode.NO_AVAILABLE_HANDLE)]
    # batches larger than one frame may hold are split by the client
    many = [f"m{i}" for i in range(P.MAX_BATCH + 10)]
    assert c.exists(many) == [False] * len(many)


def test_full_pool_of_leased_objects_refuses_puts_without_corrupting(start_server, make_client):
    # One client may hold the whole pool here (the fair-sharing quotas are tested elsewhere).
    start_server("--memory-size", "1MB", "--default_kv_lease_ttl", "60000", "--client_pool_share", "1")
    c = make_client()
    keys = [f"k{i}" for i in range(7)]
    assert c.put(keys, [[payload(k, 128 << 10)] for k in keys]) == [OK] * 7
    assert c.exists(keys, lease=True) == [True] * 7  # lookup leases pin all of them
    assert c.put(["new"], [[payload("new", 300 << 10)]]) == [int(ErrorCode.NO_AVAILABLE_HANDLE)]
    outs = [np.zeros(128 << 10, np.uint8) for _ in keys]
    assert c.get_into(keys, [[o] for o in outs]) == [OK] * 7
    assert all(payload_ok(k, o) for k, o in zip(keys, outs))


def test_commit_and_release_only_what_this_connection_was_given(start_server, make_client):
    start_server()
    a, b = make_client(name="a"), make_client(name="b")
    alloc = a.allocate(["k"], [64])
    assert alloc.codes == [OK]
    assert b.commit(alloc.handles) == [int(ErrorCode.OBJECT_NOT_FOUND)]
    assert b.exists(["k"]) == [False]
    a.arena[alloc.offsets[0] : alloc.offsets[0] + 64] = payload("k", 64)
    assert a.commit(alloc.handles) == [OK]
    lease = a.acquire(["k"])
    assert lease.codes == [OK] and lease.lease_ids[0] > 0
    assert b.release(lease.lease_ids) == [int(ErrorCode.OBJECT_NOT_FOUND)]
    assert a.release(lease.lease_ids) == [OK]
    assert a.release(lease.lease_ids) == [int(ErrorCode.OBJECT_NOT_FOUND)]


def test_expired_lease_is_reported_at_release(start_server, make_client):
    start_server("--default_kv_lease_ttl", "50")
    c = make_client()
    assert c.put(["k"], [[payload("k", 64)]]) == [OK]
    lease = c.acquire(["k"])
    import time

    time.sleep(0.15)
    assert c.release(lease.lease_ids) == [int(ErrorCode.LEASE_EXPIRED)]


def test_backend_server_from_config(start_server, sock_path):
    start_server()
    cfg = load_config({"backend": "server", "server_socket": sock_path})
    a = create_backend(cfg, "vllm-dp0-tp0-pp0")
    b = create_backend(cfg, "vllm-dp0-tp1-pp0")
    try:
        assert a.name == "server" and a.capabilities.shared_across_processes is True
        v = payload("blk", 4096)
        assert a.batch_put(["blk"], [[v[:2048], v[2048:]]]) == [OK]
        assert b.batch_exists(["blk", "nope"], lease=True) == [True, False]
        out = np.zeros(4096, np.uint8)
        assert b.batch_get_into(["blk"], [[out]]) == [OK] and np.array_equal(out, v)
        stats = b.stats()
        assert stats["store_object_count"] == 1 and stats["store_connected_clients"] == 2
        assert a.stats()["puts"] == 1 and b.stats()["gets"] == 1
    finally:
        a.close()
        b.close()


def test_backend_without_a_server_starts_and_misses(sock_path):
    cfg = load_config({"backend": "server", "server_socket": sock_path})
    backend = create_backend(cfg, "lonely")
    try:
        assert backend.batch_exists(["a"]) == [False]
        assert backend.batch_put(["a"], [[np.zeros(8, np.uint8)]]) == [int(ErrorCode.RPC_FAIL)]
        assert backend.batch_get_into(["a"], [[np.zeros(8, np.uint8)]]) == [int(ErrorCode.RPC_FAIL)]
        stats = backend.stats()  # the client's counters only: no server to ask
        assert not any(k.startswith("store_") for k in stats) and stats["failures"] == 2
    finally:
        backend.close()


@pytest.mark.parametrize("value", ["relative.sock", "", 5, "/" + "x" * 120])
def test_server_socket_config_is_validated(value):
    with pytest.raises(ConfigError) as exc:
        load_config({"backend": "server", "server_socket": value})
    assert exc.value.key == "server_socket" and "absolute Unix socket path" in str(exc.value)


# ---- metrics and `kvpool stats` ------------------------------------------------------------------


def _listening_addresses(port: int) -> list[str]:
    """Local addresses listening on TCP ``port``, from /proc/net/tcp{,6} (hex, as the kernel writes)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                found.append(addr)
    return found


def test_metrics_endpoint_on_loopback_only(start_server, make_client):
    server = start_server("--metrics_port", "0")
    port = int(server.log().split("metrics http://127.0.0.1:")[1].split()[0])
    assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1, nothing else
    c = make_client()
    c.put(["k"], [[payload("k", 100)]])
    c.get_into(["k", "x"], [[np.zeros(100, np.uint8)], [np.zeros(1, np.uint8)]])
    base = f"http://127.0.0.1:{port}"
    assert urllib.request.urlopen(base + "/healthz").read() == b"ok\n"
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    assert scrape_problems(metrics, catalog.SERVER) == []
    assert value(metrics, "kvpool_read_hits_total", tier="memory") == 1
    assert value(metrics, "kvpool_read_misses_total") == 1
    assert value(metrics, "kvpool_objects", tier="memory") == 1
    assert value(metrics, "kvpool_puts_total") == 1
    assert value(metrics, "kvpool_build_info", component="server", version=kvpool.__version__) == 1
    assert value(metrics, "kvpool_request_duration_seconds_count", op="acquire") >= 1
    assert value(metrics, "process_start_time_seconds") > 0
    # No configuration value or PID dressed as a gauge.
    assert [n for n in families(metrics) if "pid" in n or "ttl" in n] == []
    stats = json.loads(urllib.request.urlopen(base + "/stats").read())
    assert stats["object_count"] == 1 and stats["connected_clients"] == 1
    # Every number in the stats is some series' source or is left out for a stated reason, and
    # every series reads an entry that exists.
    sources = {key for series in catalog.SERVER for key in series.stats.values()}
    numbers = {k for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numbers - sources - set(catalog.SERVER_STATS_NOT_EXPORTED) == set()
    assert sources - set(stats) == set()


def test_an_idle_metrics_connection_is_closed(monkeypatch):
    # Anyone on the host can connect to the metrics port (no auth), and a scraper whose host
    # vanished mid-request never closes its end: each such connection held a thread and an fd
    # of the server for good, until the server ran out of fds for its clients.
    import socket

    from kvpool.server import metrics as server_metrics

    monkeypatch.setattr(server_metrics, "REQUEST_TIMEOUT_S", 0.3, raising=False)
    stats = lambda: {"object_count": 0}  # noqa: E731
    endpoint = server_metrics.MetricsServer("127.0.0.1", 0, stats, server_metrics.ServerMetrics(stats))
    endpoint.start()
    try:
        idle = socket.create_connection(("127.0.0.1", endpoint.port))
        idle.settimeout(30)  # a bound for the test only: the server must close it long before
        try:
            assert idle.recv(1) == b""  # closed by the server, without a request
        finally:
            idle.close()
        assert urllib.request.urlopen(f"{endpoint.url}/healthz").read() == b"ok\n"
    finally:
        endpoint.close()


def test_metrics_host_binds_the_address_given(start_server):
    server = start_server("--metrics_port", "0", "--metrics_host", "127.0.0.2")
    port = int(server.log().split("metrics http://127.0.0.2:")[1].split()[0])
    assert _listening_addresses(port) == ["0200007F"]
    assert urllib.request.urlopen(f"http://127.0.0.2:{port}/healthz").read() == b"ok\n"


def test_kvpool_stats_watch_gives_per_second_rates(start_server, make_client, sock_path):
    start_server()
    c = make_client(name="busy")
    stop = threading.Event()

    def traffic() -> None:  # puts and reads all through the watch
        i = 0
        while not stop.is_set():
            c.put([f"w{i}"], [[payload(f"w{i}", 100)]])
            c.get_into([f"w{i}"], [[np.zeros(100, np.uint8)]])
            i += 1
            time.sleep(0.005)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        out = _kvpool("stats", "--socket", sock_path, "--watch", "0.5", "--count", "3", "--json")
    finally:
        stop.set()
        worker.join()
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == 3 and lines[0]["rates"] is None
    for before, after in zip(lines, lines[1:]):
        rates, dt = after["rates"], after["interval_s"]
        assert set(rates) == stats_cli.SERVER_COUNTERS
        assert rates["puts"] > 0 and rates["hits"] > 0
        assert rates["puts"] * dt == pytest.approx(after["stats"]["puts"] - before["stats"]["puts"])
    table = _kvpool("stats", "--socket", sock_path, "--watch", "0.2", "--count", "2")
    assert table.returncode == 0 and table.stdout.count("puts/s") == 2


def test_rates_survive_a_restart_of_the_store():
    rates = stats_cli.per_second({"puts": 100, "hits": 5}, {"puts": 30, "hits": 9}, ["puts", "hits"], 2.0)
    assert rates == {"puts": 15.0, "hits": 2.0}  # puts went down: counted from zero


def _kvpool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True, timeout=60)


def test_kvpool_stats_json_table_and_errors(start_server, make_client, sock_path):
    server = start_server("--metrics_port", "0")
    port = int(server.log().split("metrics http://127.0.0.1:")[1].split()[0])
    c = make_client(name="statsclient")
    c.put(["k"], [[payload("k", 1000)]])
    c.exists(["k", "x"])
    out = _kvpool("stats", "--socket", sock_path, "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["object_count"] == 1 and s["lookup_keys"] == 2 and s["lookup_hit_rate"] == 0.5
    assert s["memory_capacity"] == 16 << 20 and s["memory_used"] >= 1000
    assert [x["name"] for x in s["client_list"]] == ["statsclient"]
    via_http = json.loads(_kvpool("stats", "--metrics-url", f"http://127.0.0.1:{port}", "--json").stdout)
    assert via_http["object_count"] == 1
    table = _kvpool("stats", "--socket", sock_path)
    assert table.returncode == 0 and "memory" in table.stdout and "hit rate" in table.stdout
    server.stop()
    gone = _kvpool("stats", "--socket", sock_path)
    assert gone.returncode == 1 and "cannot reach the kvpool server" in gone.stderr


def test_allocations_the_engine_reclaimed_do_not_pile_up_in_the_connection(sock_path, make_client, monkeypatch):
    # A client that allocates and never commits: the engine reclaims each allocation after
    # put_timeout_s; the server's own per-connection record of them must not keep them all.
    from kvpool.server import daemon

    monkeypatch.setattr(daemon, "PENDING_PRUNE_AT", 8)
    server = daemon.Server(parse_flags("--socket", sock_path, "--memory-size", "4MB", "--put_timeout", "0.2",
                                       "--client_ttl", "2"))
    server.start()
    serving = threading.Thread(target=server.serve_forever, name="test-serve", daemon=True)
    serving.start()
    try:
        client = make_client(name="leaky")
        for round_ in range(6):
            reclaimed = server.stats()["reclaimed_allocations"]
            got = client.allocate([f"r{round_}k{i}" for i in range(8)], [1024] * 8)
            assert got.codes == [OK] * 8
            deadline = time.monotonic() + 10
            while server.stats()["reclaimed_allocations"] < reclaimed + 8:
                assert time.monotonic() < deadline, "the engine never reclaimed the allocations"
                time.sleep(0.05)
        [conn] = list(server._conns.values())
        assert len(conn.pending) <= 16  # 48 allocated, all reclaimed
        assert client.commit(got.handles) == [int(ErrorCode.OBJECT_NOT_FOUND)] * 8
    finally:
        server.stop()
        serving.join(10)
        for name in arena_files(sock_path):
            shm.unlink(name)
