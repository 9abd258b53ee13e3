"""kvpool: a KV-cache pool for vLLM.

`import kvpool` and the pool engine (`kvpool.store`) need neither vLLM nor torch; the vLLM
connector lives in `kvpool.vllm` and is found by vLLM through the plugin entry point.
"""

__version__ = "0.1.0"
