"""Start a vLLM OpenAI-compatible server as a subprocess and talk to it.

Used by the demo, the end-to-end tests and the benchmarks, so it never prints: failures are
raised as `ServerError` carrying the tail of the server's log.

    with OpenAIServer(model_dir, kv_transfer_config=cfg, log_path="kvpool.log") as srv:
        r = srv.complete("Hello", max_tokens=16)
        print(r.text, r.ttft_s, r.cached_tokens)
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvpool.testing.proc import free_port, tail

# Every server gets the same thread setup. vLLM-CPU reserves one more core when a KV connector
# is configured; on a 2-core machine that changes the OpenMP thread count, so a server with the
# connector and one without would not compute at the same speed (nor always in the same order).
DEFAULT_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for the small demo models
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


class ServerError(RuntimeError):
    """The server failed to start, died, or answered a request with an error."""


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


class OpenAIServer:
    """`python -m vllm.entrypoints.openai.api_server` in its own process group.

    Entering starts it and waits for `GET /health`; leaving sends SIGTERM to the whole group
    (the API server and its engine-core child) and SIGKILL after `stop_grace_s`.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        served_model_name: str | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_model_len: int = 4096,
        block_size: int = 128,
        prefix_caching: bool = False,
        enforce_eager: bool = True,
        dtype: str = "auto",
        max_num_batched_tokens: int = 4096,
        kv_transfer_config: Mapping[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
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
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.request_timeout_s = request_timeout_s
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="kvpool-vllm-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.args: list[str] = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", host,
            "--port", str(self.port),
            "--served-model-name", self.served_model_name,
            "--max-model-len", str(max_model_len),
            "--block-size", str(block_size),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--dtype", dtype,
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            # Without it the usage record has no prompt_tokens_details.cached_tokens.
            "--enable-prompt-tokens-details",
        ]
        if enforce_eager:
            self.args.append("--enforce-eager")
        if self.kv_transfer_config is not None:
            self.args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        self.args += list(extra_args)
        self.env = {**os.environ, **DEFAULT_ENV, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: httpx.Client | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- lifecycle ----

    def start(self) -> "OpenAIServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.args)}\n".encode())
            log.flush()
            # A new session makes the server a process-group leader, so stop() reaches the
            # engine-core process it forks as well.
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )
        self._client = httpx.Client(base_url=self.base_url, timeout=self.request_timeout_s)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None and self._client is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerError(
                    f"vLLM server exited with code {rc} before it was ready; log {self.log_path}:\n"
                    f"{tail(self.log_path)}"
                )
            try:
                if self._client.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ServerError(
                    f"vLLM server not healthy after {self.startup_timeout_s:.0f} s; log {self.log_path}:\n"
                    f"{tail(self.log_path)}"
                )
            time.sleep(0.5)

    def stop(self) -> int | None:
        """Stop the server (idempotent); returns its exit code."""
        if self._client is not None:
            self._client.close()
            self._client = None
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The group may still hold the engine core even when the leader has exited.
        self._signal_group(proc, signal.SIGKILL)
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # pgid == pid: the server leads its own session
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, max_bytes: int = 6000) -> str:
        return tail(self.log_path, max_bytes)

    # ---- requests ----

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            raise ServerError("server is not running")
        return self._client

    def complete(self, prompt: str | list[int], max_tokens: int = 32, **kw: Any) -> Completion:
        """Stream one `/v1/completions` request (greedy unless `kw` says otherwise).

        Extra keyword arguments go into the request body as they are (e.g. `logprobs=5`).
        """
        body: dict[str, Any] = {
            "model": self.served_model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **kw,
        }
        text: list[str] = []
        token_ids: list[int] = []
        usage: dict[str, Any] | None = None
        finish_reason: str | None = None
        ttft: float | None = None
        t0 = time.perf_counter()
        with self.client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                raise ServerError(f"/v1/completions answered {resp.status_code}: {resp.text[:2000]}")
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServerError(f"/v1/completions streamed an error: {chunk['error']}")
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
            raise ServerError("the stream ended without a usage record")
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
        )

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


class PoolServer:
    """`kvpool server` in a child process, for the demo, tests and benchmarks.

    Entering starts it and waits until its socket accepts; leaving sends SIGTERM (a clean
    shutdown that flushes the offload tier) and SIGKILL after `stop_grace_s`.
    """

    def __init__(self, socket_path: str | os.PathLike, *, memory_size: str = "1GB",
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike | None = None,
                 startup_timeout_s: float = 30.0, stop_grace_s: float = 15.0,
                 python: str = sys.executable) -> None:
        self.socket_path = str(socket_path)
        self.args = [python, "-m", "kvpool.server.daemon", "--socket", self.socket_path,
                     "--memory-size", memory_size, *extra_args]
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="kvpool-server-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "PoolServer":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket_path)
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise ServerError(f"kvpool server exited with code {self.proc.returncode}; "
                                      f"log {self.log_path}:\n{tail(self.log_path)}") from None
                if time.monotonic() > deadline:
                    self.kill()
                    raise ServerError(f"kvpool server did not listen on {self.socket_path} in "
                                      f"{self.startup_timeout_s:.0f} s; log {self.log_path}") from None
                time.sleep(0.05)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would: no flush, no clean-up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "PoolServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
