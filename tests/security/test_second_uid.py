"""Attacks by a second local user on the pool's local paths; each must achieve nothing.

The victim is this test process (and the servers it starts); the attacker is `kvpool-attacker`
(see conftest.py). Every attack reports what it managed as counts, and the assertions are that
it read 0 bytes and wrote 0 bytes of the victim's, and that the victim sent or mapped nothing
of the attacker's.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile

import numpy as np
import pytest

from kvpool import paths
from kvpool.errors import ConfigError, ErrorCode
from kvpool.server import protocol as P
from kvpool.server import shm
from kvpool.server.client import PoolClient
from kvpool.store import DiskTier
from kvpool.testing.launch import PoolServer

# An impostor server: binds the path first, then counts connections and the bytes they send.
# With a reply, it answers every connection with that frame (a HelloReply naming its arena).
IMPOSTOR = r"""
import json, os, select, socket, sys
path, arena = sys.argv[1], sys.argv[2]
if arena:
    fd = os.open(arena, os.O_RDWR | os.O_CREAT, 0o666); os.ftruncate(fd, 1 << 20); os.fchmod(fd, 0o666); os.close(fd)
s = socket.socket(socket.AF_UNIX); s.bind(path); os.chmod(path, 0o777); s.listen(8); s.settimeout(0.05)
print("ready", flush=True)
conns = received = 0
done = False
while True:
    # After the victim is done (stdin closes), drain what is still queued in the backlog.
    done = done or bool(select.select([sys.stdin], [], [], 0)[0])
    try:
        c, _ = s.accept()
    except socket.timeout:
        if done:
            break
        continue
    conns += 1
    c.settimeout(0.5)
    try:
        while True:
            data = c.recv(65536)
            if not data:
                break
            received += len(data)
    except socket.timeout:
        pass
    c.close()
if arena:
    os.unlink(arena)
print(json.dumps({"connections": conns, "received": received}))
"""


def _impostor(attacker, path: str, arena: str = ""):
    code = f"import sys; sys.argv = ['x', {path!r}, {arena!r}]\n" + IMPOSTOR
    proc = attacker.start(code)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _victim_tries(path: str) -> PoolClient:
    client = PoolClient(path, "victim", ping=False, connect_timeout_s=1.0)
    value = np.arange(4096, dtype=np.uint8)
    assert client.put(["secret"], [[value]]) == [ErrorCode.RPC_FAIL]
    assert client.exists(["secret"]) == [False]
    assert not client.connected and client.arena is None  # nothing mapped
    return client


def test_a_socket_bound_first_in_a_sticky_dir_is_refused(attacker, shared_dir):
    sticky = os.path.join(shared_dir, "sticky")
    os.mkdir(sticky)
    os.chmod(sticky, 0o1777)
    path = os.path.join(sticky, "kvpool.sock")
    proc = _impostor(attacker, path)
    client = _victim_tries(path)
    assert client.untrusted >= 1
    client.close()
    report = attacker.finish(proc)
    assert report == {"connections": 0, "received": 0}  # refused on the socket's owner: never connected


def test_a_socket_that_looks_ours_is_refused_on_its_peer_credentials(attacker, shared_dir):
    """Whatever the path checks say (here the socket file is made ours), the kernel's word on
    the listening process decides: the client sends not one byte and maps nothing, not even the
    world-writable arena the impostor offers."""
    sticky = os.path.join(shared_dir, "sticky")
    os.mkdir(sticky)
    os.chmod(sticky, 0o1777)
    path = os.path.join(sticky, "kvpool.sock")
    arena = os.path.join(shm.SHM_DIR, shm.arena_name(path, 1))
    proc = _impostor(attacker, path, arena)
    os.chown(path, os.getuid(), os.getgid())
    client = _victim_tries(path)
    assert client.untrusted >= 1
    client.close()
    report = attacker.finish(proc)
    assert report["received"] == 0 and report["connections"] >= 1


def test_a_planted_runtime_dir_is_refused(attacker, fallback_base):
    """The classic /tmp attack: the attacker creates the victim's /tmp/kvpool-<uid> first."""
    victim_dir = paths.runtime_dir_path()
    code = (f"import json, os; os.mkdir({victim_dir!r}, 0o777); os.chmod({victim_dir!r}, 0o777)\n"
            "print(json.dumps({}))")
    attacker.run(code)
    proc = _impostor(attacker, os.path.join(victim_dir, paths.SERVER_SOCKET_NAME))
    with pytest.raises(ConfigError) as exc:
        paths.runtime_dir()
    assert exc.value.value == victim_dir
    client = _victim_tries(paths.default_server_socket())
    assert client.untrusted >= 1
    client.close()
    assert attacker.finish(proc) == {"connections": 0, "received": 0}


# The attacker against a real server: connect (the socket is 0666 so only the peer check stands
# in the way), read the reply, and try the arena file directly.
INTRUDER = r"""
import glob, json, os, socket, struct, sys
path, tag = sys.argv[1], sys.argv[2]
out = {"reply": "", "arena_reads": 0, "arena_writes": 0, "arenas": 0}
s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(path)
s.settimeout(1.0)  # a refusal comes at once; a served peer gets nothing until it says Hello
head = b""
try:
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            break
        head += chunk
except socket.timeout:
    out["waiting"] = 1
if len(head) == 4:
    n = struct.unpack("!I", head)[0]; body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            break
        body += chunk
    out["reply"] = body.hex()
# A Hello anyway (any bytes): the server has closed the connection already.
try:
    s.sendall(b"\x00\x00\x00\x01\x80"); out["after"] = s.recv(10).hex()
except OSError as e:
    out["after"] = type(e).__name__
for p in glob.glob("/dev/shm/kvpool-" + tag + "-*"):
    out["arenas"] += 1
    for flags, key in ((os.O_RDONLY, "arena_reads"), (os.O_WRONLY, "arena_writes")):
        try:
            os.close(os.open(p, flags)); out[key] += 1
        except PermissionError:
            pass
print(json.dumps(out))
"""


def _stops_cleanly(server: PoolServer) -> None:
    """Whatever the intruder did, SIGTERM still takes the clean path: exit 0, nothing left behind
    (a server that had to be SIGKILLed would leave its group-readable arena in /dev/shm)."""
    assert server.stop() == 0, server.log_tail()
    assert not os.path.exists(server.socket_path) and not os.path.exists(server.socket_path + ".lock")
    assert shm.arena_names(server.socket_path, server.pid) == []


def test_the_real_server_refuses_another_uid(attacker, shared_dir):
    sock_dir = os.path.join(shared_dir, "srv")
    os.mkdir(sock_dir)
    os.chmod(sock_dir, 0o755)
    path = os.path.join(sock_dir, "kvpool.sock")
    server = PoolServer(path, memory_size="16MB", extra_args=("--socket-mode", "0666"),
                        log_path=os.path.join(shared_dir, "server.log"), startup_timeout_s=15.0).start()
    try:
        with PoolClient(path, "victim", ping=False) as victim:
            value = np.full(4096, 7, dtype=np.uint8)
            assert victim.put(["secret"], [[value]]) == [ErrorCode.OK]
            code = f"import sys; sys.argv = ['x', {path!r}, {shm.socket_tag(path)!r}]\n" + INTRUDER
            report = attacker.run(code)
            reply = P.reply_decoder.decode(bytes.fromhex(report["reply"]))
            assert isinstance(reply, P.Error) and reply.code == ErrorCode.INVALID_PARAMS and "waiting" not in report
            assert report["arenas"] == 1 and report["arena_reads"] == 0 and report["arena_writes"] == 0
            stats, clients = victim.server_stats()
            assert stats["refused_peers"] == 1 and stats["connections"] == 1  # only the victim got in
            assert [c["name"] for c in clients] == ["victim"]
            out = np.zeros(4096, dtype=np.uint8)
            assert victim.get_into(["secret"], [[out]]) == [ErrorCode.OK] and (out == 7).all()
        _stops_cleanly(server)
    finally:
        server.stop()


def test_group_sharing_lets_exactly_that_group_in(attacker, shared_dir):
    """The same intruder, now a member of the server's --allowed_gid: served, and its group may
    map the arena. Group sharing is the one way in, and an explicit one."""
    sock_dir = os.path.join(shared_dir, "srv")
    os.mkdir(sock_dir)
    os.chmod(sock_dir, 0o755)
    path = os.path.join(sock_dir, "kvpool.sock")
    server = PoolServer(path, memory_size="16MB", extra_args=("--allowed_gid", str(attacker.gid)),
                        log_path=os.path.join(shared_dir, "server.log"), startup_timeout_s=15.0).start()
    try:
        code = f"import sys; sys.argv = ['x', {path!r}, {shm.socket_tag(path)!r}]\n" + INTRUDER
        report = attacker.run(code)
        # It sent no Hello, so the server is still waiting for one: no reply, and no refusal.
        assert report["reply"] == "" and report["waiting"] == 1
        assert report["arenas"] == 1 and report["arena_reads"] == 1
        with PoolClient(path, "victim", ping=False, allowed_gid=attacker.gid) as victim:
            stats, _ = victim.server_stats()
            assert stats["refused_peers"] == 0
        _stops_cleanly(server)
    finally:
        server.stop()


def test_an_arena_file_not_the_servers_is_never_mapped(attacker, shared_dir):
    name = shm.arena_name(os.path.join(shared_dir, "x.sock"), 2)
    path = os.path.join(shm.SHM_DIR, name)
    attacker.run(f"import json, os; fd = os.open({path!r}, os.O_RDWR | os.O_CREAT, 0o600); "
                 f"os.ftruncate(fd, 4096); os.close(fd); print(json.dumps({{}}))")
    try:
        with pytest.raises(ValueError, match="owned by uid"):
            shm.attach(name, 4096, owner_uid=os.getuid())
        os.chown(path, os.getuid(), -1)
        os.chmod(path, 0o644)
        with pytest.raises(ValueError, match="mode 0644"):
            shm.attach(name, 4096, owner_uid=os.getuid())
    finally:
        os.unlink(path)


# The attacker against the SSD tier: read and create files in the victim's directory.
SSD_PROBE = r"""
import json, os, sys
root = sys.argv[1]
out = {"reads": 0, "writes": 0, "listed": 0}
for d, _, files in os.walk(root):
    for f in files:
        try:
            open(os.path.join(d, f), "rb").read(); out["reads"] += 1
        except OSError:
            pass
try:
    out["listed"] = len(os.listdir(root))
except OSError:
    pass
for target in (os.path.join(root, "planted"), os.path.join(root, "ab", "planted")):
    try:
        open(target, "wb").write(b"x"); out["writes"] += 1
    except OSError:
        pass
print(json.dumps(out))
"""

# Plant a well-formed tier file for a key in a directory the attacker can write.
PLANT = r"""
import hashlib, json, os, struct, sys, zlib
root, key, payload = sys.argv[1], sys.argv[2].encode(), b"attacker's bytes"
digest = hashlib.sha256(key).hexdigest()
os.makedirs(os.path.join(root, digest[:2]), exist_ok=True)
head = struct.pack("<4sHHIQI", b"KVPL", 1, 0, len(key), len(payload), zlib.crc32(payload))
open(os.path.join(root, digest[:2], digest), "wb").write(head + key + payload)
print(json.dumps({"planted": 1}))
"""


def test_the_ssd_tier_is_out_of_reach(attacker, shared_dir):
    victim = os.path.join(shared_dir, "ssd")
    os.mkdir(victim, 0o700)
    disk = DiskTier(victim, 1 << 20)
    assert disk.put("secret", b"victim's bytes") == ErrorCode.OK
    report = attacker.run(f"import sys; sys.argv = ['x', {victim!r}]\n" + SSD_PROBE)
    assert report == {"reads": 0, "writes": 0, "listed": 0}
    assert disk.keys() == ["secret"] and disk.get("secret") == b"victim's bytes"
    disk.close()


@pytest.mark.parametrize("who", ["world-writable", "attacker-owned"])
def test_a_directory_the_attacker_could_write_is_never_served(attacker, shared_dir, who):
    planted = os.path.join(shared_dir, "planted")
    os.mkdir(planted)
    if who == "world-writable":
        os.chmod(planted, 0o777)
    else:
        os.chown(planted, attacker.uid, attacker.gid)
    assert attacker.run(f"import sys; sys.argv = ['x', {planted!r}, 'secret']\n" + PLANT) == {"planted": 1}
    with pytest.raises(ConfigError) as exc:
        DiskTier(planted, 1 << 20)
    assert exc.value.key == "ssd_offload_path" and exc.value.value == planted
    reads = 0
    try:
        DiskTier(planted, 1 << 20).get("secret")
        reads += 1
    except ConfigError:
        pass
    assert reads == 0


LOOKUP_PROBE = r"""
import json, os, socket, sys
path = sys.argv[1]
out = {"connected": 0, "listed": 0}
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(path); out["connected"] = 1
except OSError as e:
    out["error"] = type(e).__name__
try:
    out["listed"] = len(os.listdir(os.path.dirname(path)))
except OSError:
    pass
print(json.dumps(out))
"""


def test_the_lookup_channel_is_out_of_reach(attacker, fallback_base, monkeypatch):
    lookup = pytest.importorskip("kvpool.vllm.lookup")
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    asked = []

    def count_hits(hashes, start=0, tenant=""):
        asked.append(len(hashes))
        return len(hashes)

    server = lookup.LookupServer(4242, 0, count_hits)
    client = lookup.LookupClient(4242, 0, direct=False)  # over the socket, as another process
    try:
        assert os.path.dirname(server.path) == paths.runtime_dir_path()
        report = attacker.run(f"import sys; sys.argv = ['x', {server.path!r}]\n" + LOOKUP_PROBE)
        assert report == {"connected": 0, "listed": 0, "error": "PermissionError"}
        assert asked == []  # the attacker asked nothing
        assert client.lookup([b"a", b"b"]).blocks == 2 and asked == [2]  # the owner still can
    finally:
        client.close()
        server.close()


def test_a_shared_lookup_base_path_is_refused(monkeypatch, tmp_path):
    lookup = pytest.importorskip("kvpool.vllm.lookup")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(sticky))
    with pytest.raises(ConfigError) as exc:
        lookup.lookup_socket_path(1, 0)
    assert exc.value.key == "VLLM_RPC_BASE_PATH"
    assert os.listdir(sticky) == []


def test_a_swapped_lookup_directory_is_refused_on_its_peer_credentials(attacker, shared_dir, monkeypatch):
    """VLLM_RPC_BASE_PATH is ours and private when the instance starts, but its parent is the
    attacker's to write: the attacker moves it aside and puts its own directory, with a socket
    of the channel's name, in its place. The scheduler tells it no block hash, and a miss is all
    it can make of the lookup (without the check: the hashes, and any hit count it answers)."""
    lookup = pytest.importorskip("kvpool.vllm.lookup")
    parent = os.path.join(shared_dir, "parent")
    os.mkdir(parent)
    os.chmod(parent, 0o777)
    base = os.path.join(parent, "rpc")
    os.mkdir(base, 0o700)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", base)
    asked = []
    server = lookup.LookupServer(4343, 0, lambda hashes, start=0, tenant="": asked.append(hashes) or len(hashes))
    client = lookup.LookupClient(4343, 0, direct=False)
    try:
        swap = (f"import os, sys; os.rename({base!r}, {base + '.old'!r}); os.mkdir({base!r}); "
                f"os.chmod({base!r}, 0o777); sys.argv = ['x', {server.path!r}, '']\n")
        proc = attacker.start(swap + IMPOSTOR)
        assert proc.stdout.readline().strip() == "ready"
        assert client.lookup([b"a" * 32] * 8).blocks == 0
        report = attacker.finish(proc)
        assert report["received"] == 0 and report["connections"] >= 1
        assert asked == []
    finally:
        client.close()
        server.close()


ASK_LOOKUP = r"""
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(5)
s.connect(sys.argv[1])
body = bytes([0x92, 0x00, 0x91, 0xc4, 0x02]) + b"ab"  # msgpack [0, [b"ab"]]
try:
    s.sendall(struct.pack("!I", len(body)) + body)
    answer = s.recv(64)
except OSError as e:
    answer = b""
print(json.dumps({"answered": len(answer)}))
"""


def test_the_lookup_server_answers_no_other_uid_even_through_an_open_socket(attacker, shared_dir, monkeypatch):
    """Directory and socket opened up to everyone by mistake: the worker still asks the kernel
    who connected, and another uid gets no answer and asks nothing of the pool."""
    lookup = pytest.importorskip("kvpool.vllm.lookup")
    base = os.path.join(shared_dir, "rpc")
    os.mkdir(base, 0o700)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", base)
    asked = []
    server = lookup.LookupServer(4344, 0, lambda hashes, start=0, tenant="": asked.append(hashes) or len(hashes))
    try:
        os.chmod(base, 0o755)
        os.chmod(server.path, 0o777)
        report = attacker.run(f"import sys; sys.argv = ['x', {server.path!r}]\n" + ASK_LOOKUP)
        assert report == {"answered": 0} and asked == []
    finally:
        server.close()


def test_a_shard_of_another_uid_inside_the_tier_is_never_read_or_written(attacker, shared_dir):
    """The tier's directory is ours and passes its check, but one shard directory in it is the
    attacker's (left by an earlier misconfiguration), with a well-formed file of a key planted in
    it: a restarted tier neither serves that file nor writes a key of that shard into it."""
    import hashlib

    from kvpool.errors import StoreError

    victim = os.path.join(shared_dir, "ssd")
    os.mkdir(victim, 0o755)
    shard = os.path.join(victim, hashlib.sha256(b"secret").hexdigest()[:2])
    os.mkdir(shard, 0o755)
    os.chown(shard, attacker.uid, attacker.gid)
    assert attacker.run(f"import sys; sys.argv = ['x', {victim!r}, 'secret']\n" + PLANT) == {"planted": 1}
    disk = DiskTier(victim, 1 << 20)
    assert disk.keys() == []
    with pytest.raises(StoreError) as exc:
        disk.get("secret")
    assert exc.value.code == ErrorCode.OBJECT_NOT_FOUND
    assert disk.put("secret", b"victim's bytes") != ErrorCode.OK  # never into the attacker's shard
    assert disk.put("other", b"victim's bytes") == ErrorCode.OK and disk.get("other") == b"victim's bytes"
    disk.close()


def test_a_tier_directory_swapped_after_start_changes_nothing(attacker, shared_dir):
    """The directory's parent is the attacker's to write: after the tier started, the attacker
    moves the directory aside and puts one of its own there, with a forged file of a stored key.
    The tier keeps working in the directory it opened: it serves its own bytes, and writes
    nothing into the attacker's."""
    parent = os.path.join(shared_dir, "parent")
    os.mkdir(parent)
    os.chmod(parent, 0o777)
    victim = os.path.join(parent, "ssd")
    os.mkdir(victim, 0o700)
    disk = DiskTier(victim, 1 << 20)
    assert disk.put("secret", b"victim's bytes") == ErrorCode.OK
    swap = f"import os; os.rename({victim!r}, {victim + '.old'!r}); os.mkdir({victim!r}, 0o755)\n"
    assert attacker.run(swap + f"import sys; sys.argv = ['x', {victim!r}, 'secret']\n" + PLANT) == {"planted": 1}
    assert disk.get("secret") == b"victim's bytes"
    assert disk.put("later", b"more bytes") == ErrorCode.OK and disk.get("later") == b"more bytes"
    planted_shards = [d for d in os.listdir(victim)]
    assert all(os.stat(os.path.join(victim, d)).st_uid == attacker.uid for d in planted_shards)
    assert sorted(os.listdir(victim + ".old")) != []  # where the tier still keeps its files
    disk.close()


# ---- another user is one owner, whatever processes it runs ---------------------------------------------------

# As the other user: `n` processes, each one connection that says Hello and allocates (its own key);
# then one more connection per process until the server refuses. Frames are built by the test.
MANY_PROCESSES = r"""
import json, os, socket, struct, sys
path, n, hello = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
allocs = [bytes.fromhex(a) for a in sys.argv[4].split(",")]
def frame(s):
    head = b""
    while len(head) < 4:
        head += s.recv(4 - len(head))
    size = struct.unpack("!I", head)[0]; body = b""
    while len(body) < size:
        body += s.recv(size - len(body))
    return body
def conn():
    s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(path); s.sendall(hello); return s, frame(s)
out = {"allocations": [], "more": 0, "refused": 0}
reads = []
for i in range(n):  # n processes, one connection and one allocation each, all held
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        s, _ = conn()
        s.sendall(allocs[i])
        os.write(w, frame(s).hex().encode())
        os.close(w)
        os.read(0, 1)  # hold it until the test is done
        os._exit(0)
    os.close(w)
    reads.append(r)
for r in reads:
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    out["allocations"].append(data.decode())
held = []
for _ in range(40):  # then more connections from this process, until refused
    c, reply = conn()
    held.append(c)
    if b"--max-connections-per-uid" in reply:
        out["refused"] = 1
        break
    out["more"] += 1
print(json.dumps(out), flush=True)
sys.stdin.read()
"""


def test_another_user_is_one_owner_whatever_processes_it_runs(attacker, shared_dir):
    """Group sharing: another uid's processes share one pool share and one connection budget, so
    starting more processes buys it nothing (with per-process quotas three processes would pin
    90% of the pool)."""
    sock_dir = os.path.join(shared_dir, "srv")
    os.mkdir(sock_dir)
    os.chmod(sock_dir, 0o755)
    path = os.path.join(sock_dir, "kvpool.sock")
    server = PoolServer(path, memory_size="64MB", log_path=os.path.join(shared_dir, "server.log"), startup_timeout_s=15.0,
                        extra_args=("--allowed_gid", str(attacker.gid), "--max_connections_per_uid", "12",
                                    "--put_timeout", "60")).start()
    try:
        with PoolClient(path, "victim", allowed_gid=attacker.gid) as victim:
            cap = victim.server_stats()[0]["memory_capacity"]
            hello = bytes(P.encode_frame(P.Hello("other", 1))).hex()
            alloc = ",".join(bytes(P.encode_frame(P.Allocate([f"x{i}"], [int(cap * 0.3)]))).hex() for i in range(3))
            proc = attacker.start(f"import sys; sys.argv = ['x', {path!r}, '3', {hello!r}, {alloc!r}]\n" + MANY_PROCESSES)
            report = json.loads(proc.stdout.readline())
            codes = [P.reply_decoder.decode(bytes.fromhex(a)).codes[0] for a in report["allocations"]]
            # Each process asks for 30%: the first gets it, the others would pass the user's 50%.
            assert codes.count(ErrorCode.OK) == 1 and codes.count(ErrorCode.NO_AVAILABLE_HANDLE) == 2, codes
            assert 3 + report["more"] == 12 and report["refused"] == 1  # --max_connections_per_uid, all processes
            owners = {c["owner"] for c in victim.server_stats()[1]}
            assert owners == {f"uid:{attacker.uid}", f"pid:{os.getpid()}"}
            # The victim's own share is untouched.
            assert victim.put(["mine"], [[np.zeros(int(cap * 0.4), np.uint8)]]) == [ErrorCode.OK]
            proc.communicate("", timeout=20)
    finally:
        server.stop()
