"""Runs one vLLM engine in its own process and answers commands on stdin/stdout.

Tests share engines (see conftest.py and each module's fixtures): an engine takes 10-20 s to
start on 2 cores. Separate processes keep engines from sharing state.

Protocol: one JSON object per line.
- {"prompts": [[token ids], ...], "max_tokens": n}
  -> {"results": [{"token_ids", "logprobs", "num_cached_tokens", "finish_reason", "error"}]}
  Prompts run one at a time, in order (each round's hits depend on the previous round's saves),
  and each to the end: after a request finished, the engine is stepped until vLLM holds no
  finished request any more, i.e. until the connector reported its saves done and its blocks
  were freed. So a request's saves are in the pool before the next request looks it up.
- {"reset_prefix_cache": true} -> {"results": [], "reset": bool}: empty vLLM's prefix cache.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback

DRAIN_TIMEOUT_S = 120.0


def _scheduler(llm):
    """vLLM's scheduler when the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def _drain(llm) -> None:
    """Step the engine until no finished request waits for the connector (delayed free)."""
    sched = _scheduler(llm)
    if sched is None:
        return  # a separate engine-core process steps itself
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while sched.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(f"requests still held by vLLM after {DRAIN_TIMEOUT_S:.0f} s: {list(sched.requests)}")
        llm.llm_engine.step()
        time.sleep(0.002)


def _log_kvpool_to_stdout() -> None:
    """kvpool's records (its counters among them) on stdout, where the test reads them.

    kvpool.vllm hands its records to vLLM's handlers when it is imported after vLLM configured
    its logger; with the engine core in this process it is imported before, and INFO records
    would be lost.
    """
    ours = logging.getLogger("kvpool")
    if ours.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def main() -> None:
    spec = json.loads(sys.argv[1])
    _log_kvpool_to_stdout()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**spec)
    out = sys.stdout
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("reset_prefix_cache"):
            _drain(llm)
            out.write(json.dumps({"results": [], "reset": bool(llm.reset_prefix_cache())}) + "\n")
            out.flush()
            continue
        sp = SamplingParams(max_tokens=cmd.get("max_tokens", 4), temperature=0.0, logprobs=5, ignore_eos=True)
        results = []
        for ids in cmd["prompts"]:
            try:
                o = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
                c = o.outputs[0]
                results.append({
                    "token_ids": list(c.token_ids),
                    "logprobs": [sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[:5]
                                 for step in (c.logprobs or [])],
                    "num_cached_tokens": o.num_cached_tokens,
                    "finish_reason": c.finish_reason,
                    "error": None,
                })
            except Exception as e:  # a failed request is a result the tests inspect
                results.append({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})
            _drain(llm)
        out.write(json.dumps({"results": results}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
