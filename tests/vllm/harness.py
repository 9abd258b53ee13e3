"""Helpers for end-to-end tests on real vLLM: engine processes, prompts, configs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).parent
BLOCK = 128
VOCAB_LOW, VOCAB_HIGH = 3, 2000  # skip the special tokens of the generated tokenizer


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


_port = iter(range(100, 10_000))


def kvpool_config(role: str = "kv_both", policy: str = "recompute", **extra) -> dict:
    """A kv-transfer-config using kvpool with a lookup channel no other engine of this run uses."""
    extra.setdefault("lookup_rpc_port", f"{os.getpid() % 1000}{next(_port)}")
    extra.setdefault("local_cpu_size", "256MB")
    extra.setdefault("stats_log_interval_s", 0)  # log kvpool's counters at every step with activity
    return {
        "kv_connector": "KVPoolConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra,
    }


class Engine:
    """A vLLM engine in a child process (see engine_server.py)."""

    def __init__(self, model: str, kv_transfer_config: dict | None = None, prefix_caching: bool = False,
                 dtype: str = "float32", max_num_batched_tokens: int = 512, env: dict | None = None,
                 tensor_parallel_size: int = 1) -> None:
        spec = {
            "model": model, "dtype": dtype, "enforce_eager": True, "max_model_len": 4096,
            "block_size": BLOCK, "enable_prefix_caching": prefix_caching,
            "max_num_batched_tokens": max_num_batched_tokens, "seed": 0,
            "tensor_parallel_size": tensor_parallel_size,
        }
        if kv_transfer_config is not None:
            spec["kv_transfer_config"] = kv_transfer_config
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **(env or {})}
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine_server.py"), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
        )
        self._lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()
        self._wait_line(lambda l: l.startswith("READY"), timeout=300)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.log.append(line)
                if line.startswith("READY") or line.startswith('{"results"'):
                    self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _wait_line(self, pred, timeout: float) -> str:
        with self._cond:
            ok = self._cond.wait_for(lambda: any(pred(l) for l in self._lines) or self.proc.poll() is not None,
                                     timeout=timeout)
            for i, l in enumerate(self._lines):
                if pred(l):
                    return self._lines.pop(i)
        tail = "".join(self.log[-60:])
        raise RuntimeError(f"engine {'timed out' if not ok else 'exited'}; log tail:\n{tail}")

    def generate(self, prompts: list[list[int]], max_tokens: int = 4, timeout: float = 300) -> list[dict]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._wait_line(lambda l: l.startswith('{"results"'), timeout))["results"]

    def log_text(self) -> str:
        with self._cond:
            return "".join(self.log)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


