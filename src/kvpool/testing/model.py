"""Build a small random-weight Llama with a locally trained tokenizer, so nothing is downloaded.

The weights are random but seeded, so greedy outputs are deterministic: good enough to show
that KV loaded from the pool gives exactly the numbers that recomputing it gives.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    """Shape of the generated model; `tiny` for tests, `bench` (~100M parameters) for TTFT."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 2048
    max_position_embeddings: int = 16384
    dtype: str = "float32"
    seed: int = 0


SPECS = {
    "tiny": ModelSpec(),
    "tiny-bf16": ModelSpec(dtype="bfloat16"),
    # 96.0M parameters (12 x 7.47M per layer + 2 x 3.1M embeddings/LM head). Stored fp32;
    # vLLM's `--dtype auto` serves it in bf16 on CPU: 12 KiB of KV per token, 96 MiB for 8K.
    "bench": ModelSpec(
        hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, vocab_size=4096,
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


def build_model(out_dir: str | os.PathLike, spec: ModelSpec = ModelSpec()) -> Path:
    """Write a seeded random Llama and its tokenizer to `out_dir` (skipped if already built)."""
    out = Path(out_dir)
    marker = out / "kvpool_model_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == dataclasses.asdict(spec):
        return out
    steps = _Steps(4, f"building model in {out}")
    try:
        with steps.step("importing torch and transformers"):  # seconds of their own on a cold start
            import torch  # noqa: F401
            import transformers  # noqa: F401

        out.mkdir(parents=True, exist_ok=True)
        with steps.step("training the tokenizer"):
            build_tokenizer(out, spec.vocab_size)
        with steps.step("random weights"):
            model = _random_llama(spec)
        with steps.step("writing safetensors"), _quiet_transformers():
            model.save_pretrained(str(out), safe_serialization=True)
    finally:
        steps.close()
    marker.write_text(json.dumps(dataclasses.asdict(spec)))
    return out


def _random_llama(spec: ModelSpec) -> Any:
    """The seeded random-weight Llama of `spec`, in memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    model = LlamaForCausalLM(config)
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
