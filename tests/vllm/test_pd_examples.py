"""The spec's deployment, with the example scripts as they are: one `kvpool server` per host,
and vLLM's OpenAI server instances sharing it.

- PD disaggregation: a prefill node (`multi_producer.sh`, `kv_producer`, which saves and, as the
  spec's producer does, loads pooled prefixes) and a decode node
  (`multi_consumer.sh`, `kv_consumer` + `consumer_is_to_load`); `kvpool proxy` sends each request
  through both. The decode node must find the prefill's blocks on the first try (the proxy sends
  the decode request the moment the prefill answers), and the answers must be exactly what one
  instance gives.
- A PD-mixed instance (`pd_mix.sh`: the spec's kv-transfer-config as written, the connector
  named `AscendStoreConnector` through the plugin entry point, the spec's serving flags) on the
  same pool: it hits what another instance computed.
- The pool server shared across processes: killed under running instances it costs misses,
  never errors or hangs; a new one on the same socket is found again; blocks outlive the
  instance that wrote them.

Answers are compared as text (greedy token ids), never as logprobs: the instances cache and
compute different parts of the prompts. Every instance here is started once for the module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvpool.demo.run import LONG_QUESTION, SHORT_QUESTION
from kvpool.testing.launch import IN_PROCESS_WORKER_ENV, free_port, private_temp_env
from kvpool.testing.proc import unix_socket_accepts

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 128
DOC = "\n\n".join([LONG_QUESTION] * 3)  # ~1300 tokens: 10 whole blocks
QUESTIONS = (SHORT_QUESTION, LONG_QUESTION, DOC)
LATE_DOC = "\n\n".join([SHORT_QUESTION, LONG_QUESTION, SHORT_QUESTION, LONG_QUESTION])  # asked around the pool's restart


class Script:
    """One of examples/*.sh in its own process group."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, port: int | None = None) -> None:
        self.name, self.port = name, port
        self.log = log_dir / f"{name}-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(["bash", str(ROOT / "examples" / f"{name}.sh")], env=env,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")

    def wait_http(self, path: str = "/health", timeout: float = 300) -> "Script":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not come up: {self.log.read_text()[-3000:]}")

    def wait_socket(self, path: str, timeout: float = 60) -> "Script":
        """Until the Unix socket accepts (a socket file left by a killed server does not)."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            if unix_socket_accepts(path):
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not come up: {self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL to the whole group, as a crash would."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def ask(port: int, prompt: str) -> dict:
    # The spec's curl body, with max_tokens (what vLLM's /v1/completions reads).
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
        "model": "model", "prompt": prompt, "max_tokens": 24, "temperature": 0.0})
    assert r.status_code == 200, r.text
    return r.json()


def text(answer: dict) -> str:
    return answer["choices"][0]["text"]


def cached(answer: dict, key: str = "cached_tokens") -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get(key) or 0


def hit_tokens(answer: dict) -> int:
    """What a full pool hit of this prompt gives: its whole blocks, less the one token vLLM
    must compute when the prompt is all whole blocks."""
    n = answer["usage"]["prompt_tokens"]
    return min(n // BLOCK * BLOCK, n - 1)


class Deployment:
    def __init__(self, tmp_path: Path, model_dir: str) -> None:
        self.tmp = tmp_path
        self.sock = str(tmp_path / "pool.sock")
        self.base = {**os.environ, "MODEL": model_dir, "PYTHON": sys.executable, **private_temp_env(str(tmp_path), os.environ),
                     "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "KVPOOL_SOCKET": self.sock}
        self.running: list[Script] = []
        self.prefill_port, self.decode_port, self.mix_port, self.proxy_port = (free_port() for _ in range(4))

    def start(self, name: str, **env: str) -> Script:
        port = int(env["PORT"]) if "PORT" in env else None
        s = Script(name, {**self.base, **env}, self.tmp, port)
        self.running.append(s)
        return s

    def start_pool(self) -> Script:
        self.pool = self.start("pool_server").wait_socket(self.sock)
        return self.pool

    def up(self) -> "Deployment":
        self.start_pool()
        # The prefill node runs in vLLM's default layout (the model in a Worker process of its
        # own, apart from the scheduler); the other two in the engine core's process, which
        # starts sooner (IN_PROCESS_WORKER_ENV). The scripts are the same either way.
        nodes = [
            self.start("multi_producer", PORT=str(self.prefill_port), LOOKUP_RPC_PORT="0"),
            self.start("multi_consumer", PORT=str(self.decode_port), LOOKUP_RPC_PORT="1", **IN_PROCESS_WORKER_ENV),
            self.start("pd_mix", PORT=str(self.mix_port), LOOKUP_RPC_PORT="2", **IN_PROCESS_WORKER_ENV),
        ]
        self.mix = nodes[2]
        for n in nodes:
            n.wait_http()
        self.start("proxy", PORT=str(self.proxy_port), PREFILLER_PORTS=str(self.prefill_port),
                   DECODER_PORTS=str(self.decode_port)).wait_http("/healthcheck")
        return self

    def down(self) -> None:
        for s in reversed(self.running):
            s.stop()


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("pd"), model_dir)
    try:
        yield d.up()
    finally:
        d.down()


def test_pd_through_the_pool_equals_one_instance(deployment):
    d = deployment
    through_pd = {}
    for q in QUESTIONS:
        answer = ask(d.proxy_port, q)
        # Found at once, on the first request: every whole block the prefill computed.
        assert cached(answer, "decode_cached_tokens") == hit_tokens(answer), answer["usage"]
        through_pd[q] = text(answer)
    for q in QUESTIONS:
        # The prefill node loads pooled prefixes (as the spec's producer does): asked again, it
        # finds the blocks it saved for the PD request.
        alone = ask(d.prefill_port, q)
        assert cached(alone) == hit_tokens(alone) and text(alone) == through_pd[q], alone["usage"]
        # The PD-mixed instance loads the blocks the prefill node saved.
        mixed = ask(d.mix_port, q)
        assert cached(mixed) == hit_tokens(mixed) and text(mixed) == through_pd[q], mixed["usage"]


def test_pool_server_restart_and_blocks_outliving_their_writer(deployment):
    d = deployment
    d.pool.kill()  # the pool server dies under three running instances: misses, not errors
    miss = ask(d.mix_port, LATE_DOC)
    assert cached(miss) == 0
    expected = text(ask(d.prefill_port, LATE_DOC))  # one instance computing all of it (no pool to load from)
    assert text(miss) == expected

    d.start_pool()  # a new server on the same socket: the instances find it again
    deadline = time.monotonic() + 30
    while True:
        again = ask(d.mix_port, LATE_DOC)  # saves once reconnected, then hits
        if cached(again) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert cached(again) == hit_tokens(again) and text(again) == expected

    d.mix.stop()  # the writer is gone; its blocks are not
    deadline = time.monotonic() + 30
    while True:
        decoded = ask(d.decode_port, LATE_DOC)  # the decode node loads, never saves
        if cached(decoded) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert cached(decoded) == hit_tokens(decoded) and text(decoded) == expected
