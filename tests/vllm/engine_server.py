"""Runs one vLLM engine in its own process and answers generate commands on stdin/stdout.

Each test module starts the engines it needs once and shares them between its tests (an
engine takes ~15 s to start here). Separate processes keep engines from sharing state.
Protocol: one JSON object per line. Command {"prompts": [[token ids], ...], "max_tokens": n}
-> {"results": [{"token_ids", "logprobs", "num_cached_tokens", "error"}]}.
"""

from __future__ import annotations

import json
import sys
import traceback


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**spec)
    out = sys.stdout
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        sp = SamplingParams(max_tokens=cmd.get("max_tokens", 4), temperature=0.0, logprobs=5, ignore_eos=True)
        results = []
        # One request at a time, in order: each round's hits depend on the previous round's saves.
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
        out.write(json.dumps({"results": results}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
