"""Generated preference pairs and a tiny random Qwen3 checkpoint that fits their words.

A prompt is a few neutral words; the chosen answer holds a positive word among neutral ones, the
rejected answer a negative one. The tiny checkpoint follows examples/classification/toy_data.py
(a word-level tokenizer trained on the words, a random 2-layer Qwen3 of hidden size 64), with a
``tokenizer_config.json`` naming its end and padding tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import d9d.hf
from d9d.hf import DecoderCausalLM
from d9d.hf.qwen3 import Qwen3DenseConfig

SPECIAL_TOKENS = ["<pad>", "<unk>", "<eos>"]
TINY_PAD = 0
"""``<pad>``'s id in the tiny checkpoint's tokenizer (the first special token)."""
POSITIVE = ["good", "great", "love", "nice", "happy", "fine"]
NEGATIVE = ["bad", "awful", "hate", "poor", "sad", "ugly"]
NEUTRAL = [f"w{i}" for i in range(48)]


def _answer(rng: random.Random, mood: list[str]) -> str:
    words = rng.choices(NEUTRAL, k=rng.randint(2, 5))
    words.insert(rng.randint(0, len(words)), rng.choice(mood))
    return " ".join(words)


def write_pairs(path: Path, count: int, *, seed: int) -> None:
    """``count`` JSONL rows ``{"prompt", "chosen", "rejected"}`` (chosen: a positive word)."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(count):
        prompt = " ".join(rng.choices(NEUTRAL, k=rng.randint(2, 4)))
        row = {"prompt": prompt, "chosen": _answer(rng, POSITIVE), "rejected": _answer(rng, NEGATIVE)}
        lines.append(json.dumps(row) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))


def write_tiny_checkpoint(directory: Path, *, seed: int) -> None:
    """A random 2-layer causal-LM Qwen3 (hidden 64) with a word-level tokenizer of the data's words."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    words = " ".join(NEUTRAL + POSITIVE + NEGATIVE)
    tokenizer.train_from_iterator([words], trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    assert tokenizer.token_to_id("<pad>") == TINY_PAD
    config = Qwen3DenseConfig(
        model_type="qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=TINY_PAD,
        eos_token_id=tokenizer.token_to_id("<eos>"),
    )
    torch.manual_seed(seed)
    model = DecoderCausalLM(config)
    model.reset_parameters()
    staging = directory.parent / f".{directory.name}.partial"
    d9d.hf.save_pretrained(model, staging)
    tokenizer.save(str(staging / "tokenizer.json"))
    special = {"eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (staging / "tokenizer_config.json").write_text(json.dumps(special, indent=2) + "\n")
    staging.rename(directory)  # complete or absent: a rerun never finds half a checkpoint
