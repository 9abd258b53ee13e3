"""Helpers for end-to-end tests on real vLLM: engine processes, prompts, configs, counters."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).parent
BLOCK = 128
VOCAB_LOW, VOCAB_HIGH = 3, 2000  # skip the special tokens of the generated tokenizer

# Every engine of this suite runs with these, so engines compute alike and may be compared:
# the same two cores, no core reserved for the connector, a small KV cache. The engine core
# runs inside the engine's process (no second process to start and import vLLM into: ~10 s
# less per engine on 2 cores); tensor-parallel workers are still processes of their own.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
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


# "kvpool (tp0 pp0): lookups=1, lookup_hit_blocks=7, load_blocks=7, ..." (PoolWorker.get_stats)
_STATS_LINE = re.compile(r"kvpool \((tp\d+ pp\d+)\): (.*)$")


class Engine:
    """A vLLM engine (`vllm.LLM`) in a child process, driven over stdin/stdout (engine_server.py).

    Requests run one at a time, each to the end, IO included: when `generate` returns, every
    save of those requests is in the pool and their blocks are free again.
    """

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
        full_env = {**os.environ, **ENGINE_ENV, **(env or {})}
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine_server.py"), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
        )
        self._lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self._wait_line(lambda l: l.startswith("READY"), timeout=300)
        except BaseException:
            self.close()
            raise

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

    def _call(self, cmd: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._wait_line(lambda l: l.startswith('{"results"'), timeout))

    def generate(self, prompts: list[list[int]], max_tokens: int = 4, timeout: float = 300) -> list[dict]:
        """Greedy generation, one prompt after the other; per prompt: token_ids, top-5 logprobs,
        num_cached_tokens, finish_reason, error (None unless the request failed)."""
        return self._call({"prompts": prompts, "max_tokens": max_tokens}, timeout)["results"]

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

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
