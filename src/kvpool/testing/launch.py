"""The programs the demo, the tests and the benchmarks start as subprocesses: vLLM's OpenAI
server (`OpenAIServer`), `kvpool server` (`PoolServer`) and `kvpool proxy` (`ProxyServer`), on
one lifecycle (`ChildProcess`): a log file, start with or without waiting for ready, stop
(SIGTERM, then SIGKILL), kill, pause (SIGSTOP), pid, alive, exit code.

Nothing here prints: failures are raised as `ServerError` carrying the tail of the log.

    with OpenAIServer(model_dir, kv_transfer_config=cfg, log_path="kvpool.log") as srv:
        r = srv.complete("Hello", max_tokens=16)
        print(r.text, r.ttft_s, r.cached_tokens)
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvpool.testing.proc import free_port, group_alive, sigstop, tail, unix_socket_accepts, wait_for

__all__ = [
    "DEFAULT_ENV", "IN_PROCESS_WORKER_ENV", "ChildProcess", "Completion", "OpenAIServer", "PoolServer", "ProxyServer",
    "ServerError", "every_instance_in_rotation", "free_port", "parse_metric", "private_temp_env", "stream_completion",
]

# Every server gets the same thread setup. vLLM-CPU reserves one more core when a KV connector
# is configured; on a 2-core machine that changes the OpenMP thread count, so a server with the
# connector and one without would not compute at the same speed (nor always in the same order).
DEFAULT_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for the small demo models
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}

# vLLM-CPU runs the model in a Worker process of its own, beside the engine core, unless
# VLLM_ENABLE_V1_MULTIPROCESSING=0 (then the engine core, still a process apart from the API
# server, runs it). One import of vLLM fewer: a server starts ~13 s of CPU sooner (33 s against
# 46 s alone on a 2-core EPYC). Tests whose point is not the process layout pass it; the prefill
# node of tests/vllm/test_pd_examples.py and the benchmarks keep vLLM's default layout, so
# kvpool's scheduler side and worker side in separate processes stay covered.
IN_PROCESS_WORKER_ENV: dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class ServerError(RuntimeError):
    """The server failed to start, died, or answered a request with an error."""


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


_P = TypeVar("_P", bound="ChildProcess")


class ChildProcess:
    """One program run as a child process with its output in a log file, and its lifecycle.

    Subclasses give the command line and `_ready()`, the check `start()` and `wait_ready()`
    poll until the program serves. Entering starts it and waits; leaving stops it.
    """

    name = "process"  # in error messages and the default log file's name
    # A process that forks workers (vLLM's engine core) gets a session of its own, so that
    # signals go to the whole process group and no child outlives it.
    new_session = True
    log_command = True  # write "$ <command line>" into the log before starting it
    poll_interval_s = 0.1

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike[str] | None = None, startup_timeout_s: float = 30.0,
                 stop_grace_s: float = 15.0) -> None:
        self.args = [str(a) for a in args]
        self.env = dict(env) if env is not None else None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"kvpool-{self.name.replace(' ', '-')}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None  # start -> ready, once it was
        self._started_at = 0.0
        self._log_offset = 0  # where this run's output begins in the log
        self._paused = False
        self._group_killed = False

    # ---- lifecycle ----

    def start(self: _P, wait: bool = True) -> _P:
        """Start it; with `wait`, return once it is ready (stopping it and raising ServerError if
        it exits or is not ready within `startup_timeout_s`)."""
        if self.alive():
            raise ServerError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            if self.log_command:
                log.write(f"$ {' '.join(self.args)}\n".encode())
            self._log_offset = log.tell()
            self._started_at = time.monotonic()
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=self.new_session)
        self.startup_s = None
        self._paused = self._group_killed = False
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()
                raise
        return self

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Poll until `_ready()`; ServerError (the log's tail in it) if the process exits first or
        `timeout_s` (default `startup_timeout_s`) passes. Does not stop it."""
        proc = self._proc()
        timeout = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = self._started_at + timeout if timeout_s is None else time.monotonic() + timeout
        while True:
            rc = proc.poll()
            if rc is not None:
                raise ServerError(f"{self.name} exited with code {rc} before it was ready; log {self.log_path}:\n"
                                  f"{self.log_tail()}")
            if self._ready():
                self.startup_s = time.monotonic() - self._started_at
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name} not ready after {timeout:.0f} s; log {self.log_path}:\n"
                                  f"{self.log_tail()}")
            time.sleep(self.poll_interval_s)

    def _ready(self) -> bool:
        """Whether the program serves now (called while it runs)."""
        raise NotImplementedError

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM (the clean shutdown) and wait; SIGKILL after `grace_s` (default `stop_grace_s`).

        Returns the exit code (`-SIGKILL` when it had to be killed), None if it never started.
        Idempotent: once it exited, returns that exit code again.
        """
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            self.send_signal(signal.SIGTERM)
            if self._paused:  # a stopped process acts on SIGTERM only once continued
                self.resume()
            grace = self.stop_grace_s if grace_s is None else grace_s
            deadline = time.monotonic() + grace
            try:
                proc.wait(timeout=grace)
                if self.new_session:
                    # The rest of the group finishes its own clean-up first: Python's resource
                    # tracker unlinks vLLM's shared memory once the leader is gone, and a
                    # SIGKILL in the middle of that leaves the segments in /dev/shm.
                    wait_for(lambda: not group_alive(proc.pid), max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL, as a crash would (no flush, no clean-up); returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if self.new_session and not self._group_killed:
            # The group may still hold children (vLLM's engine core) when the leader has exited.
            # Once only: after that the group id is free for the system to reuse.
            _killpg(proc.pid, signal.SIGKILL)
            self._group_killed = True
        elif proc.poll() is None:
            proc.kill()
        self._paused = False
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP, as a hung process: alive and holding its sockets, but answering nothing.
        Returns once every thread has stopped."""
        sigstop(self._proc().pid, timeout_s)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after `pause()`."""
        self.send_signal(signal.SIGCONT)
        self._paused = False

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the process (to its process group when it leads one); nothing once it exited."""
        proc = self._proc()
        if proc.poll() is not None:
            return
        if self.new_session:
            _killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    def wait(self, timeout_s: float | None = 15.0) -> int:
        """Wait for it to exit on its own; its exit code (subprocess.TimeoutExpired after `timeout_s`)."""
        return self._proc().wait(timeout_s)

    # ---- state ----

    def _proc(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            raise ServerError(f"{self.name} was not started")
        return self.proc

    @property
    def pid(self) -> int:
        """The process id (ServerError before `start()`); it stays readable after it exited."""
        return self._proc().pid

    def alive(self) -> bool:
        """Started and not exited (a paused process is alive)."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code, or None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def log(self) -> str:
        """The whole log file ("" if there is none yet)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, max_bytes: int = 6000) -> str:
        """The log's last `max_bytes`, for error messages."""
        return tail(self.log_path, max_bytes)

    def _log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def __enter__(self: _P) -> _P:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- vLLM's OpenAI server ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Completion:
    """One streamed completion, with the timings and cache accounting the server reported."""

    text: str
    token_ids: list[int]
    num_tokens: int  # completion tokens, from the usage record
    ttft_s: float  # request sent -> first chunk carrying a generated token
    total_s: float  # request sent -> stream closed
    prompt_tokens: int
    # Prompt tokens not computed for this request: vLLM's own prefix cache plus the KV
    # connector's hits (vLLM 0.32 sums both into `num_cached_tokens`). With prefix caching off,
    # this is exactly what the pool served.
    cached_tokens: int
    finish_reason: str | None
    # The usage record as sent: `kvpool proxy` adds `prompt_tokens_details.decode_cached_tokens`.
    usage: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The response headers (lower-case names): `kvpool proxy` says there which instance served.
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


def stream_completion(client: httpx.Client, model: str, prompt: str | list[int], max_tokens: int = 32,
                      **kw: Any) -> Completion:
    """Stream one `/v1/completions` request (greedy unless `kw` says otherwise) through `client`
    (a vLLM server or `kvpool proxy`, by its base URL).

    Extra keyword arguments go into the request body as they are (e.g. `logprobs=5`).
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **kw,
    }
    where = f"{client.base_url}v1/completions"
    text: list[str] = []
    token_ids: list[int] = []
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    ttft: float | None = None
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as resp:
        headers = {k.lower(): v for k, v in resp.headers.items()}
        if resp.status_code != 200:
            resp.read()
            raise ServerError(f"{where} answered {resp.status_code}: {resp.text[:2000]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"{where} streamed an error: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ttft is None and (ids or choice.get("text")):
                    ttft = time.perf_counter() - t0
                token_ids.extend(ids)
                text.append(choice.get("text") or "")
                finish_reason = choice.get("finish_reason") or finish_reason
            if chunk.get("usage"):
                usage = chunk["usage"]
    total = time.perf_counter() - t0
    if usage is None:
        raise ServerError(f"{where}: the stream ended without a usage record")
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        text="".join(text),
        token_ids=token_ids,
        num_tokens=int(usage.get("completion_tokens") or 0),
        ttft_s=ttft if ttft is not None else total,
        total_s=total,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        finish_reason=finish_reason,
        usage=usage,
        headers=headers,
    )


RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def private_temp_env(directory: str, env: Mapping[str, str]) -> dict[str, str]:
    """Variables that put a vLLM process's leftovers in `directory`, which its owner removes.

    vLLM leaves its engine's IPC sockets (under VLLM_RPC_BASE_PATH, default /tmp) and its
    workers' rendezvous files (`vllm_dist_*`, mode 0644, in the temp directory) behind after it
    stops. torch's compile cache would follow TMPDIR too: it stays where `env` would have put it,
    so that a start does not compile everything again.
    """
    inductor = env.get(INDUCTOR_CACHE_ENV) or os.path.join(env.get("TMPDIR") or tempfile.gettempdir(),
                                                           f"torchinductor_{getpass.getuser()}")
    return {RPC_DIR_ENV: directory, "TMPDIR": directory, INDUCTOR_CACHE_ENV: inductor}


class OpenAIServer(ChildProcess):
    """`python -m vllm.entrypoints.openai.api_server` in its own process group.

    Ready once `GET /health` answers 200; `stop()` sends SIGTERM to the whole group (the API
    server and its engine-core child) and SIGKILL after `stop_grace_s`.
    """

    name = "vLLM server"
    poll_interval_s = 0.5

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        served_model_name: str | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_model_len: int = 4096,
        block_size: int | None = 128,  # None: vLLM's choice (it raises it for models with state layers)
        prefix_caching: bool = False,
        enforce_eager: bool = True,
        dtype: str = "auto",
        max_num_batched_tokens: int = 4096,
        kv_transfer_config: Mapping[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 180.0,
        stop_grace_s: float = 15.0,
        request_timeout_s: float = 300.0,
        python: str = sys.executable,
    ) -> None:
        self.model = str(model)
        self.served_model_name = served_model_name or Path(self.model).name or self.model
        self.host = host
        self.port = port or free_port(host)
        self.kv_transfer_config = dict(kv_transfer_config) if kv_transfer_config else None
        self.request_timeout_s = request_timeout_s
        args: list[str] = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", host,
            "--port", str(self.port),
            "--served-model-name", self.served_model_name,
            "--max-model-len", str(max_model_len),
            *(("--block-size", str(block_size)) if block_size is not None else ()),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--dtype", dtype,
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            # Without it the usage record has no prompt_tokens_details.cached_tokens.
            "--enable-prompt-tokens-details",
        ]
        if enforce_eager:
            args.append("--enforce-eager")
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        args += list(extra_args)
        super().__init__(args, env={**os.environ, **DEFAULT_ENV, **(env or {})}, log_path=log_path,
                         startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s)
        self._client: httpx.Client | None = None
        # vLLM's IPC sockets and temp files go to one directory (`private_temp_env`): the one the
        # caller chose for the sockets, else a private one per start, removed when the server is
        # stopped or killed.
        self._own_rpc_dir = not (self.env or {}).get(RPC_DIR_ENV)
        self._rpc_dir: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def healthy(self) -> bool:
        """Whether it runs and `GET /health` answers 200 now."""
        try:
            return self.client.get("/health", timeout=2.0).status_code == 200
        except (httpx.HTTPError, ServerError):
            return False  # not listening (yet), or exited

    _ready = healthy

    def start(self, wait: bool = True) -> OpenAIServer:
        if self._own_rpc_dir and self._rpc_dir is None and not self.alive():
            self._rpc_dir = tempfile.mkdtemp(prefix="kvpool-vllm-rpc-")  # mode 0700
        assert self.env is not None
        self.env.update(private_temp_env(self._rpc_dir or self.env[RPC_DIR_ENV], self.env))
        return super().start(wait)

    def stop(self, grace_s: float | None = None) -> int | None:
        """`ChildProcess.stop`, after closing the HTTP client."""
        if self._client is not None:
            self._client.close()
            self._client = None
        return super().stop(grace_s)

    def kill(self) -> int | None:
        """`ChildProcess.kill`, then the removal of the private directory (if it made one)."""
        code = super().kill()
        if self._rpc_dir is not None and (self.proc is None or self.proc.poll() is not None):
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None
        return code

    # ---- requests ----

    @property
    def client(self) -> httpx.Client:
        """An HTTP client of the server, while it runs."""
        if not self.alive():
            raise ServerError(f"{self.name} is not running" + (f" (exit code {self.returncode})" if self.proc else ""))
        if self._client is None:
            self._client = httpx.Client(base_url=self.base_url, timeout=self.request_timeout_s)
        return self._client

    def complete(self, prompt: str | list[int], max_tokens: int = 32, **kw: Any) -> Completion:
        """Stream one `/v1/completions` request (`stream_completion`)."""
        return stream_completion(self.client, self.served_model_name, prompt, max_tokens, **kw)

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of `prompt` as the server's tokenizer sees it."""
        r = self.client.post("/tokenize", json={"model": self.served_model_name, "prompt": prompt})
        if r.status_code != 200:
            raise ServerError(f"/tokenize answered {r.status_code}: {r.text[:2000]}")
        return list(r.json()["tokens"])

    def metrics(self) -> str:
        """The Prometheus text of `/metrics`."""
        r = self.client.get("/metrics")
        r.raise_for_status()
        return r.text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of metric `name` whose labels include `labels` (0.0 if none)."""
        return parse_metric(self.metrics(), name, **labels)


def parse_metric(text: str, name: str, **labels: str) -> float:
    """Sum the samples named `name` in Prometheus text whose label set includes `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        metric, _, label_text = sample.partition("{")
        if metric != name:
            continue
        found = dict(
            (k.strip(), v.strip().strip('"'))
            for k, _, v in (p.partition("=") for p in label_text.rstrip("}").split(",") if p)
        )
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


# ---- kvpool server -------------------------------------------------------------------------------

_QUIET_LOG_LEVELS = ("WARNING", "ERROR", "CRITICAL")


def _flag_value(args: Sequence[str], name: str) -> str | None:
    """The last value given to `--name` in `args`, in either spelling (`_` or `-`, `--f v` or `--f=v`)."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    value = None
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag in spellings:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


class PoolServer(ChildProcess):
    """`kvpool server` (`python -m kvpool.server.daemon`) on a Unix socket.

    Ready once it logs "kvpool server <pid> listening on" (after its arena, engine and metrics
    endpoint are up, so the whole start-up line is in the log). `stop()` sends SIGTERM, the
    clean shutdown that flushes the offload tier and removes socket and arena; exit code 0.

    `memory_size=None` passes no `--memory-size` (the flags in `extra_args` say it); `entry` is
    what follows the interpreter (`("-m", "kvpool.cli", "server")` runs the CLI subcommand).
    The server stays in the caller's process group, so a Ctrl-C reaches it too.
    """

    name = "kvpool server"
    new_session = False
    log_command = False  # the log is the daemon's output only: tests read it
    poll_interval_s = 0.01

    def __init__(self, socket_path: str | os.PathLike[str], *, memory_size: str | int | None = "1GB",
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike[str] | None = None,
                 entry: Sequence[str] = ("-m", "kvpool.server.daemon"), env: Mapping[str, str] | None = None,
                 startup_timeout_s: float = 30.0, stop_grace_s: float = 15.0,
                 python: str = sys.executable) -> None:
        self.socket_path = str(socket_path)
        args = [python, *entry, "--socket", self.socket_path]
        if memory_size is not None:
            args += ["--memory-size", str(memory_size)]
        args += list(extra_args)
        super().__init__(args, env=env, log_path=log_path, startup_timeout_s=startup_timeout_s,
                         stop_grace_s=stop_grace_s)
        level = (_flag_value(self.args, "log_level") or "INFO").upper()
        self._logs_listening = level not in _QUIET_LOG_LEVELS

    def _ready(self) -> bool:
        if self._logs_listening:
            return f"kvpool server {self.pid} listening on" in self._log_since_start()
        # Not logging INFO: ours is up when it holds the socket's lock and the socket accepts.
        return self._lock_holder() == self.pid and unix_socket_accepts(self.socket_path)

    def _lock_holder(self) -> int | None:
        try:
            return int(Path(self.socket_path + ".lock").read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None


# ---- kvpool proxy --------------------------------------------------------------------------------


class ProxyServer(ChildProcess):
    """`python -m kvpool.proxy` (the PD load balancer) in its own process group, in front of
    prefill and decode instances on `backend_host` (or, with `instance_ports` and no prefill or
    decode ports, PD-mixed instances); ready once `/healthcheck` answers 200.
    `entry` is what follows the interpreter (`("-m", "kvpool.cli", "proxy")`: the subcommand)."""

    name = "kvpool proxy"
    poll_interval_s = 0.3

    def __init__(self, prefill_ports: Sequence[int], decode_ports: Sequence[int], *, host: str = "127.0.0.1",
                 port: int | None = None, backend_host: str = "127.0.0.1", extra_args: Sequence[str] = (),
                 entry: Sequence[str] = ("-m", "kvpool.proxy"), env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike[str] | None = None, startup_timeout_s: float = 60.0,
                 stop_grace_s: float = 15.0, python: str = sys.executable,
                 instance_ports: Sequence[int] = ()) -> None:
        self.host = host
        self.port = port or free_port()
        args = [python, *entry, "--host", host, "--port", str(self.port)]
        if instance_ports:
            args += ["--instance-hosts", backend_host, "--instance-ports", *map(str, instance_ports)]
        if prefill_ports or decode_ports or not instance_ports:
            args += ["--prefiller-hosts", backend_host, "--prefiller-ports", *map(str, prefill_ports),
                     "--decoder-hosts", backend_host, "--decoder-ports", *map(str, decode_ports)]
        args += list(extra_args)
        super().__init__(args, env=env, log_path=log_path, startup_timeout_s=startup_timeout_s,
                         stop_grace_s=stop_grace_s)

    @property
    def base_url(self) -> str:
        """Where clients send requests: the proxy's own address."""
        return f"http://{self.host}:{self.port}"

    def _ready(self) -> bool:
        try:
            r = httpx.get(f"{self.base_url}/healthcheck", timeout=2, trust_env=False)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and every_instance_in_rotation(r.json())


def every_instance_in_rotation(health: Mapping[str, Any]) -> bool:
    """Whether a proxy's `/healthcheck` answer has every instance it was given in rotation.

    Its 200 says only that each role has one: the first requests after it would all go to that
    one, which skews a benchmark's round robin and a test's expectation of where a request goes.
    """
    roles = [k[:-len("_instances")] for k in health if k.endswith("_instances") and not k.startswith("healthy_")]
    return bool(roles) and all(health.get(f"healthy_{r}_instances") == health[f"{r}_instances"] for r in roles)

