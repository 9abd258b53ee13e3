"""A prompt's block hashes as a vLLM instance computes them, for `kvpool ctl` to name a prompt's
blocks to the pool's controller.

vLLM computes them itself here (its request's block hasher), so they are the instance's exactly:
the same chain, hash function, seed (`PYTHONHASHSEED` must match the instance's, as vLLM's own
rule for sharing blocks across instances says) and `cache_salt`.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, hash_algo: str = "sha256",
                        cache_salt: str | None = None) -> list[bytes]:
    """The hashes of the prompt's whole blocks of ``block_size`` tokens, in order (vLLM's
    ``--prefix-caching-hash-algo`` ``hash_algo``)."""
    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    request = Request(request_id="kvpool-ctl", prompt_token_ids=list(token_ids),
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None, cache_salt=cache_salt,
                      block_hasher=get_request_block_hasher(block_size, hash_fn))
    return [bytes(h) for h in request.block_hashes]
