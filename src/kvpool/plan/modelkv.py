"""The KV bytes one token takes in the pool, read from a model's config (`kvpool plan --model`).

Counted from the Hugging Face config.json alone (no weights, no transformers): every attention
layer's K and V (full, sliding-window or chunked: the pool keeps every block a layer computed),
or MLA's one latent per layer (`kv_lora_rank + qk_rope_head_dim`), in the model's own dtype.
Layers without a per-token cache (Mamba, linear attention, convolutions) hold a state per
request instead; the pool stores those states at block boundaries too, which this count leaves
out: pass `--kv-bytes-per-token` to plan with them. `--kv-cache-dtype` is vLLM's flag of that
name (auto: the model's dtype).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
# vLLM's --kv-cache-dtype choices kvpool's planner takes, and their bytes (auto: the model's).
KV_CACHE_DTYPES = {"auto": 0, "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
_FLAG = "--model"


def _field(cfg: dict[str, Any], name: str, where: str) -> Any:
    value = cfg.get(name)
    if value is None:
        raise ConfigError(_FLAG, where, f"a config.json with {name!r}, or pass --kv-bytes-per-token instead")
    return value


def attention_layers(cfg: dict[str, Any]) -> int:
    """How many layers keep a per-token KV cache."""
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list):
        return sum(1 for k in kinds if k == "attention" or (str(k).endswith("_attention") and k != "linear_attention"))
    return int(cfg.get("num_hidden_layers") or 0)


def kv_bytes_per_token(model_dir: str, kv_cache_dtype: str = "auto") -> tuple[int, str]:
    """(bytes per token, how they were counted) for the model in ``model_dir``, its KV cache in
    ``kv_cache_dtype``."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(_FLAG, model_dir, f"a model directory with a readable config.json ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(_FLAG, model_dir, "a config.json holding a JSON object")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg  # multimodal: its LM
    where = str(path)
    dtype = kv_cache_dtype
    if dtype == "auto":
        dtype = str(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or "")
        if dtype not in DTYPE_BYTES:
            raise ConfigError(_FLAG, where, f"a dtype of {', '.join(DTYPE_BYTES)} (config says {dtype or 'none'}), "
                                            "or pass --kv-cache-dtype")
    size = DTYPE_BYTES.get(dtype) or KV_CACHE_DTYPES[dtype]
    layers = attention_layers(text)
    if layers <= 0:
        raise ConfigError(_FLAG, where, "a model with attention layers (none found), or pass --kv-bytes-per-token")
    if text.get("kv_lora_rank"):  # MLA: one compressed latent and the rotary part per token and layer
        latent = int(text["kv_lora_rank"]) + int(_field(text, "qk_rope_head_dim", where))
        return layers * latent * size, f"{layers} MLA layers x {latent} x {size} B ({dtype})"
    heads = int(text.get("num_key_value_heads") or _field(text, "num_attention_heads", where))
    head_dim = int(text.get("head_dim") or int(_field(text, "hidden_size", where)) // int(
        _field(text, "num_attention_heads", where)))
    return (2 * layers * heads * head_dim * size,
            f"2 x {layers} attention layers x {heads} KV heads x {head_dim} x {size} B ({dtype})")
