"""PD disaggregation through the pool, with the example scripts as they are.

A prefill node (`kv_producer`) and a decode node (`kv_consumer` + `consumer_is_to_load`) share
one `kvpool server`; `kvpool proxy` sends each request through both. The spec's short and long
questions through the proxy must give exactly what one PD-mixed instance (`pd_mix.sh`) gives,
and the decode node must find the prefill's blocks on the first try: the proxy sends the
decode request the moment the prefill answers.
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
from kvpool.testing.launch import free_port

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
DOC = "\n\n".join([LONG_QUESTION] * 3)  # ~1300 tokens: 10 whole blocks


class Script:
    """One of examples/*.sh in its own process group."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, port: int | None = None) -> None:
        self.name, self.port = name, port
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(["bash", str(ROOT / "examples" / f"{name}.sh")], env=env,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_http(self, path: str = "/health", timeout: float = 300) -> "Script":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not come up: {self.log.read_text()[-3000:]}")

    def wait_socket(self, path: str, timeout: float = 30) -> "Script":
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not come up: {self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def ask(port: int, prompt: str) -> dict:
    # The spec's curl body, with max_tokens (what vLLM's /v1/completions reads).
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
        "model": "model", "prompt": prompt, "max_tokens": 24, "temperature": 0.0})
    assert r.status_code == 200, r.text
    return r.json()


def test_pd_through_pool_equals_pd_mixed(model_dir, tmp_path):
    base = {**os.environ, "MODEL": model_dir, "PYTHON": sys.executable, "VLLM_RPC_BASE_PATH": str(tmp_path),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    running: list[Script] = []

    def start(name: str, **env: str) -> Script:
        port = int(env["PORT"]) if "PORT" in env else None
        s = Script(name, {**base, **env}, tmp_path, port)
        running.append(s)
        return s

    try:
        # Reference: one PD-mixed instance with its own pool.
        mixed_sock = str(tmp_path / "mixed.sock")
        start("pool_server", KVPOOL_SOCKET=mixed_sock).wait_socket(mixed_sock)
        mix_port = free_port()
        mix = start("pd_mix", PORT=str(mix_port), KVPOOL_SOCKET=mixed_sock, LOOKUP_RPC_PORT="2").wait_http()
        expected = {q: ask(mix_port, q)["choices"][0]["text"] for q in (SHORT_QUESTION, LONG_QUESTION, DOC)}
        mix.stop()

        sock = str(tmp_path / "pd.sock")
        start("pool_server", KVPOOL_SOCKET=sock).wait_socket(sock)
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        prefill = start("multi_producer", PORT=str(p_port), KVPOOL_SOCKET=sock, LOOKUP_RPC_PORT="0")
        decode = start("multi_consumer", PORT=str(d_port), KVPOOL_SOCKET=sock, LOOKUP_RPC_PORT="1")
        prefill.wait_http()
        decode.wait_http()
        start("proxy", PORT=str(x_port), PREFILLER_PORTS=str(p_port), DECODER_PORTS=str(d_port)).wait_http("/healthcheck")

        for q in (SHORT_QUESTION, LONG_QUESTION, DOC):
            answer = ask(x_port, q)
            assert answer["choices"][0]["text"] == expected[q]
            usage = answer["usage"]
            # Found at once, on the first request: every whole block the prefill computed.
            whole = usage["prompt_tokens"] // 128 * 128
            assert usage["prompt_tokens_details"].get("decode_cached_tokens", 0) == whole, usage
    finally:
        for s in reversed(running):
            s.stop()
