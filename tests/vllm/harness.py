"""Helpers for end-to-end tests on real vLLM: engine processes, prompts, configs, counters."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvpool.testing.launch import IN_PROCESS_WORKER_ENV, OpenAIServer, PoolServer, private_temp_env
from kvpool.testing.proc import free_ports

HERE = Path(__file__).parent
BLOCK = 128
VOCAB_LOW, VOCAB_HIGH = 3, 2000  # skip the special tokens of the generated tokenizer

# Every engine of this suite runs with these, so engines compute alike and may be compared:
# the same two cores, no core reserved for the connector, a small KV cache. The engine core
# runs inside the engine's process (no second process to start and import vLLM into);
# tensor-parallel workers are still processes of their own.
# vLLM's IPC sockets and temp files (and kvpool's lookup channels) go to a directory of this
# run's own: vLLM leaves them behind, and its default is /tmp.
_RPC_DIR = tempfile.mkdtemp(prefix="kvpool-e2e-rpc-")
atexit.register(shutil.rmtree, _RPC_DIR, ignore_errors=True)
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    **private_temp_env(_RPC_DIR, os.environ),
}


def tokens(n: int, seed: int) -> list[int]:
    """`n` random token ids; every test prompt has its own seed, so no two tests share a block
    and one engine can serve many tests."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def whole(prompt: list[int]) -> int:
    """Tokens in the whole blocks of `prompt`."""
    return len(prompt) // BLOCK * BLOCK


_port = iter(range(100, 10_000))


def lookup_port() -> str:
    """A lookup channel no other engine of this run uses (ports are per host)."""
    return f"{os.getpid() % 1000}{next(_port)}"


def pooled_config(stack: contextlib.ExitStack, tmp: Path, backend: str, **extra) -> dict:
    """`kvpool_config` for `backend`: `local`, or a `kvpool server` in `tmp`, started on `stack`
    (stopped with it)."""
    if backend == "local":
        return kvpool_config(**extra)
    sock = str(tmp / "pool.sock")
    stack.enter_context(PoolServer(sock, memory_size="512MB", log_path=tmp / "pool.log"))
    return kvpool_config(backend="server", server_socket=sock, **extra)


def kv_events_config() -> dict:
    """vLLM's `--kv-events-config` publishing over ZMQ on loopback ports of this run's own, with
    a replay buffer (`replay_kv_events` reads it)."""
    pub, replay = free_ports(2)
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}


def replay_kv_events(config: dict, quiet_s: float = 0.3, timeout_s: float = 30.0) -> list:
    """Every event the engine published since it started, decoded with vLLM's own classes, in
    order: its publisher's replay buffer, read until two reads agree (the publisher sends from a
    thread of its own, so the last events may still be on their way)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    last: list | None = None
    while True:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(config["replay_endpoint"])
        try:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            events: list = []
            while True:
                if not sock.poll(int(timeout_s * 1000)):
                    raise RuntimeError("the KV-event publisher's replay did not answer")
                frames = sock.recv_multipart()
                _, _, seq, payload = frames
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                events.extend(decoder.decode(payload).events)
        finally:
            sock.close()
        if events == last or time.monotonic() > deadline:
            return events
        last = events
        time.sleep(quiet_s)


def kvpool_config(role: str = "kv_both", policy: str = "recompute", **extra) -> dict:
    """A kv-transfer-config using kvpool with a lookup channel of its own."""
    extra.setdefault("lookup_rpc_port", lookup_port())
    if extra.get("backend", "local") == "local":
        extra.setdefault("local_cpu_size", "256MB")
    extra.setdefault("stats_log_interval_s", 0)  # log kvpool's counters at every step with activity
    return {
        "kv_connector": "KVPoolConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra,
    }


class _ForkServer:
    """engine_server.py --fork-server: vLLM imported once, an engine process forked per Engine."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvpool-e2e-")
        self.path = os.path.join(self.dir, "fork.sock")
        self.log_path = os.path.join(self.dir, "fork-server.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(HERE / "engine_server.py"), "--fork-server", self.path],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **ENGINE_ENV})
        deadline = time.monotonic() + 300
        while "READY" not in Path(self.log_path).read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"engine fork server did not start:\n{Path(self.log_path).read_text()[-5000:]}")
            time.sleep(0.05)

    def spawn(self, spec: dict, env: dict[str, str]) -> "_Forked":
        child_in, stdin = os.pipe()
        stdout, child_out = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX) as conn:
                conn.connect(self.path)
                socket.send_fds(conn, [b"f"], [child_in, child_out])
                conn.sendall(json.dumps({"spec": spec, "env": env}).encode())
                conn.shutdown(socket.SHUT_WR)
                answer = b""
                while chunk := conn.recv(4096):
                    answer += chunk
        except BaseException:
            for fd in (stdin, stdout):
                os.close(fd)
            raise
        finally:
            os.close(child_in)
            os.close(child_out)
        if not answer:
            raise RuntimeError(f"engine fork server failed:\n{Path(self.log_path).read_text()[-5000:]}")
        return _Forked(json.loads(answer)["pid"], os.fdopen(stdin, "w"), os.fdopen(stdout, "r"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class _Forked:
    """The part of subprocess.Popen that Engine uses, for a process of the fork server."""

    def __init__(self, pid: int, stdin, stdout) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = 0  # gone (reaped by the fork server; its code is not ours to read)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engine pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the engine leads its own process group
        except (ProcessLookupError, PermissionError):
            pass


_fork_server: _ForkServer | None = None
_fork_lock = threading.Lock()


def _spawn(spec: dict, env: dict[str, str]):
    """Start an engine process: forked from the fork server (unless KVPOOL_E2E_FORK_SERVER=0)."""
    global _fork_server
    if os.environ.get("KVPOOL_E2E_FORK_SERVER", "1") == "0":
        return subprocess.Popen([sys.executable, str(HERE / "engine_server.py"), json.dumps(spec)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
    with _fork_lock:
        if _fork_server is None or not _fork_server.alive():
            _fork_server = _ForkServer()
            atexit.register(_fork_server.close)
        server = _fork_server
    return server.spawn(spec, env)


# "kvpool (tp0 pp0): lookups=1, lookup_hit_blocks=7, load_blocks=7, ..." (PoolWorker.get_stats)
_STATS_LINE = re.compile(r"kvpool \((tp\d+ pp\d+)\): (.*)$")


class Engine:
    """A vLLM engine (`vllm.LLM`) in a child process, driven over stdin/stdout (engine_server.py).

    Requests run one at a time, each to the end, IO included: when `generate` returns, every
    save of those requests is in the pool and their blocks are free again.
    """

    def __init__(self, model: str, kv_transfer_config: dict | None = None, prefix_caching: bool = False,
                 dtype: str = "float32", max_num_batched_tokens: int = 512, env: dict | None = None,
                 tensor_parallel_size: int = 1, wait: bool = True, **llm_args) -> None:
        spec = {
            "model": model, "dtype": dtype, "enforce_eager": True, "max_model_len": 4096,
            "block_size": BLOCK, "enable_prefix_caching": prefix_caching,
            "max_num_batched_tokens": max_num_batched_tokens, "seed": 0,
            "tensor_parallel_size": tensor_parallel_size, **llm_args,
        }
        if kv_transfer_config is not None:
            spec["kv_transfer_config"] = kv_transfer_config
        self.spec = spec
        self.groups: dict | None = None  # what vLLM made of the model, once it serves
        self.log: list[str] = []
        self._lines: list[str] = []
        self._eof = False
        self._cond = threading.Condition()
        self.proc = _spawn(spec, {**os.environ, **ENGINE_ENV, **(env or {})})
        threading.Thread(target=self._pump, daemon=True).start()
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 300) -> "Engine":
        """Until the engine serves (`wait=False` starts it without waiting: start several
        engines, then wait for each, and their start-ups overlap)."""
        try:
            self._wait_line(lambda l: l.startswith("READY"), timeout=timeout)
        except BaseException:
            self.close()
            raise
        with self._cond:
            line = next((l for l in self.log if l.startswith("GROUPS ")), "GROUPS null")
        self.groups = json.loads(line[len("GROUPS "):])
        record_matrix_engine(self)
        return self

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.log.append(line)
                if line.startswith("READY") or line.startswith('{"results"'):
                    self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _wait_line(self, pred, timeout: float) -> str:
        with self._cond:
            ok = self._cond.wait_for(lambda: any(pred(l) for l in self._lines) or self._eof, timeout=timeout)
            for i, l in enumerate(self._lines):
                if pred(l):
                    return self._lines.pop(i)
        tail = "".join(self.log[-60:])
        raise RuntimeError(f"engine {'timed out' if not ok else 'exited'}; log tail:\n{tail}")

    def _call(self, cmd: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._wait_line(lambda l: l.startswith('{"results"'), timeout))

    def generate(self, prompts: list[list[int]], max_tokens: int = 4, timeout: float = 300,
                 kv_transfer_params: dict | None = None) -> list[dict]:
        """Greedy generation, one prompt after the other; per prompt: token_ids, top-5 logprobs,
        num_cached_tokens, finish_reason, error (None unless the request failed).
        `kv_transfer_params` go with every request, as an API request's would."""
        return self._call({"prompts": prompts, "max_tokens": max_tokens, "kv_transfer_params": kv_transfer_params},
                          timeout)["results"]

    def pool_keys(self, timeout: float = 60) -> list[str]:
        """The keys in the engine's `local` pool (TP=1), once its requests' IO is done."""
        return self._call({"pool_keys": True}, timeout)["pool_keys"]

    def reset_prefix_cache(self, timeout: float = 60) -> None:
        """Empty vLLM's own prefix cache (not the pool)."""
        if not self._call({"reset_prefix_cache": True}, timeout).get("reset"):
            raise RuntimeError("vLLM did not reset its prefix cache")

    def mark(self) -> int:
        """A position in the log, for `counters(since=...)`."""
        with self._cond:
            return len(self.log)

    def counters(self, since: int = 0, rank: str = "tp0 pp0") -> dict[str, float]:
        """kvpool's counters of worker `rank`, summed over the stats lines logged since `since`.

        kvpool logs them at every step with IO (stats_log_interval_s=0), before the step's
        output reaches the caller; with requests run to the end, a `generate` call's counters
        are all in the log when it returns.
        """
        total: dict[str, float] = {}
        with self._cond:
            lines = self.log[since:]
        for line in lines:
            m = _STATS_LINE.search(line.rstrip())
            if m is None or m.group(1) != rank:
                continue
            for part in m.group(2).split(", "):
                k, _, v = part.partition("=")
                total[k] = total.get(k, 0) + float(v)
        return total

    def log_text(self) -> str:
        with self._cond:
            return "".join(self.log)

    def begin_close(self) -> None:
        """Ask the engine to shut down (it finishes its IO first), without waiting."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self, timeout: float = 60) -> None:
        """Shut down and wait for the exit (SIGKILL after `timeout`)."""
        self.begin_close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL, where how the engine would shut down is not the test's business (a client
        of a dead store may wait out its timeouts first)."""
        self.begin_close()
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()




# ---- The model matrix (`make test-models`: tests/vllm/model_matrix.py) ----------------------

MATRIX_ENV = "KVPOOL_MODEL_MATRIX"  # a JSON-lines file: each engine a test started, each outcome


def record_matrix(entry: dict) -> None:
    """Append `entry` to the matrix file, where a run asked for one."""
    path = os.environ.get(MATRIX_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _built(model: str) -> dict | None:
    marker = Path(model) / "kvpool_model_spec.json"
    return json.loads(marker.read_text()) if marker.exists() else None


def record_matrix_model(model: str, label: str) -> None:
    """A model a test served otherwise than through `Engine` (OpenAI servers), as `label` says."""
    if os.environ.get(MATRIX_ENV):
        record_matrix({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0], "model": _built(model),
                       "label": label, "groups": None, "pooled": None})


def record_matrix_engine(engine: "Engine") -> None:
    """The engine a test started: its model's spec (as built), its groups, its pool backend."""
    if not os.environ.get(MATRIX_ENV):
        return
    kv = engine.spec.get("kv_transfer_config") or {}
    if kv.get("kv_connector") == "MultiConnector":  # kvpool's entry among them
        kv = next((c for c in kv["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "KVPoolConnector"), {})
    extra = kv.get("kv_connector_extra_config") or {}
    record_matrix({
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "model": _built(engine.spec["model"]),
        "kv_cache_dtype": engine.spec.get("kv_cache_dtype", "auto"),
        "tp": engine.spec.get("tensor_parallel_size", 1),
        "connector": kv.get("kv_connector"),
        "backend": extra.get("backend", "local") if kv else None,
        "prefix_caching": engine.spec.get("enable_prefix_caching", False),
        **(engine.groups or {"groups": None, "pooled": None}),
    })


# ---- Reading what a pool holds (tests/vllm/test_mla_models.py) -------------------------------

def vllm_block_hashes(prompt: list[int], block_size: int) -> list[bytes]:
    """vLLM 0.32's prefix hashes of `prompt`'s whole blocks, as its scheduler computes them with
    the default `prefix_caching_hash_algo` "sha256" (SHA-256 of a pickle, chained from NONE_HASH,
    derived from PYTHONHASHSEED or the fixed seed "vllm-none-hash") for a plain token prompt (no
    LoRA, multimodal input or cache_salt: no extra keys). kvpool's keys end with these."""
    import hashlib
    import pickle

    def sha256(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent = sha256(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
    hashes = []
    for start in range(0, len(prompt) // block_size * block_size, block_size):
        parent = sha256((parent, tuple(prompt[start:start + block_size]), None))
        hashes.append(parent)
    return hashes


# "kvpool worker ready: backend=server role=kv_both key=MODEL@LAYOUT@tp0/1@pp0/1@g0@00000000; group 0
# (full): 147456 bytes per block in 4 layers; ..." (PoolWorker.register_kv_caches, one per worker)
_READY_LINE = re.compile(r"kvpool worker ready: .*? key=(\S+)@00000000; group 0 \([^)]*\): (\d+) bytes per block")


def pool_key_prefixes(engine: Engine) -> list[tuple[str, int]]:
    """(key without its block hash, bytes per block) of group 0, as each worker of `engine` logged
    them at start-up, in log order (one per TP rank)."""
    return [(m.group(1), int(m.group(2))) for m in _READY_LINE.finditer(engine.log_text())]


def read_pool_values(socket_path: str, keys: list[str], size: int) -> list[bytes | None]:
    """Each key's bytes in the `kvpool server` at `socket_path` (None where it is not there), read
    with kvpool's own client: what a load of that key copies into vLLM's KV cache."""
    import numpy as np

    from kvpool.errors import OK
    from kvpool.server.client import PoolClient

    with PoolClient(socket_path, "test-reader", ping=False) as client:
        bufs = [np.zeros(size, np.uint8) for _ in keys]
        codes = client.get_into(keys, [[b] for b in bufs])
    return [b.tobytes() if code == OK else None for b, code in zip(bufs, codes)]


def remove_pool_values(socket_path: str, keys: list[str]) -> list[int]:
    """Remove `keys` from the `kvpool server` at `socket_path` (so the next lookup misses them);
    the store's code per key (0: removed)."""
    from kvpool.server.client import PoolClient

    with PoolClient(socket_path, "test-remover", ping=False) as client:
        return client.remove(keys)


@contextlib.contextmanager
def instances_on_one_pool(model: str, tmp: Path, count: int, lookup_port_base: int,
                          pool_args: tuple[str, ...] = (), pool_env: dict[str, str] | None = None):
    """A `kvpool server` and `count` vLLM OpenAI servers (PD-mixed, prefix caching on, the model
    run in the engine core's process) using it, started together; yields (pool, servers) and
    stops them all, whatever happened. ``pool_env``: variables added to the pool's environment."""
    sock = str(tmp / "pool.sock")
    pool = PoolServer(sock, memory_size="512MB", log_path=tmp / "pool.log", extra_args=list(pool_args),
                      env={**os.environ, **pool_env} if pool_env else None)
    servers = [
        OpenAIServer(model, served_model_name="model", block_size=BLOCK, prefix_caching=True, dtype="float32",
                     max_num_batched_tokens=512, log_path=tmp / f"instance{i}.log", startup_timeout_s=600,
                     env={"VLLM_RPC_BASE_PATH": str(tmp), **IN_PROCESS_WORKER_ENV},
                     kv_transfer_config={
                         "kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                         "kv_load_failure_policy": "recompute",
                         "kv_connector_extra_config": {"backend": "server", "server_socket": sock,
                                                       "lookup_rpc_port": lookup_port_base + i}})
        for i in range(count)]
    started = []
    try:
        pool.start()
        started.append(pool)
        for s in servers:  # start-ups overlap
            s.start(wait=False)
            started.append(s)
        for s in servers:
            s.wait_ready()
        yield pool, servers
    finally:
        for p in reversed(started):
            p.stop()
