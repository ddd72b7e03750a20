"""Build the project's default policy: a tiny Qwen2 causal LM with a character-level tokenizer.

Nothing can be downloaded at run time, so the default model is made here, deterministically
from a seed, and saved with ``save_pretrained`` so that both transformers (the trainer) and
vLLM (the rollout engine) load it from the same directory.

    python -m modules.policy.tiny_model artifacts/tiny-qwen-base          # build with defaults

Differences from a real checkpoint: random weights, a 30-symbol vocabulary, and float32 so
that engine and trainer logprobs agree to ~1e-6 on a CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
# Every printable symbol a task may use. Tasks must stay inside this alphabet.
ALPHABET = list("0123456789+-*/%=,.;:|()<> ?abcdefghijklmnopqrstuvwxyz")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, ids fixed by ``ALPHABET``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split every character into its own "word"; Fuse joins them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="right",
        model_max_length=1024,
    )


def build_tiny_qwen(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    init_std: float = 0.02,
) -> Path:
    """Create and save a randomly initialised Qwen2 model plus its tokenizer.

    The same ``seed`` and sizes always give bit-identical weights.
    """
    out = Path(out_dir)
    tokenizer = build_char_tokenizer()
    vocab_size = 64  # >= len(tokenizer); a round number keeps kernels happy
    assert len(tokenizer) <= vocab_size
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
        use_sliding_window=False,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
    ).save_pretrained(out)
    (out / "asyncrl_build.json").write_text(json.dumps({"seed": seed, "builder": __name__}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untied", action="store_true", help="separate lm_head weights")
    args = parser.parse_args()
    path = build_tiny_qwen(args.out_dir, seed=args.seed, tie_word_embeddings=not args.untied)
    print(f"saved tiny Qwen2 to {path}")


if __name__ == "__main__":
    main()
