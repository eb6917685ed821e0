"""A generated sentiment-like data set and a tiny random Qwen3 checkpoint that fits its words.

The tiny checkpoint follows examples/finetune-qwen3/toy_setup.py (a word-level tokenizer trained on
the texts, a random 2-layer Qwen3 of hidden size 64 saved with d9d.hf), with the data's words.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import d9d.hf
from d9d.hf import DecoderCausalLM
from d9d.hf.qwen3 import Qwen3DenseConfig

SPECIAL_TOKENS = ["<pad>", "<unk>", "<eos>"]
POSITIVE = ["good", "great", "love", "nice", "happy", "fine"]
NEGATIVE = ["bad", "awful", "hate", "poor", "sad", "ugly"]
NEUTRAL = [f"w{i}" for i in range(48)]


@dataclass(frozen=True, kw_only=True)
class LabelledText:
    """One sample: its id, its text and its class (1: it holds a positive word, 0: a negative one)."""

    id: int
    text: str
    label: int


def generate_texts(count: int, *, seed: int, max_words: int) -> list[LabelledText]:
    """``count`` texts of 4 to ``max_words`` neutral words with one or two words of their class."""
    rng = random.Random(seed)
    texts: list[LabelledText] = []
    for index in range(count):
        label = rng.randrange(2)
        words = rng.choices(NEUTRAL, k=rng.randint(4, max_words - 2))
        for word in rng.choices(POSITIVE if label else NEGATIVE, k=rng.randint(1, 2)):
            words.insert(rng.randint(0, len(words)), word)
        texts.append(LabelledText(id=index, text=" ".join(words), label=label))
    return texts


def vocabulary_texts() -> list[str]:
    """Every word of the data set, for training the toy tokenizer."""
    return [" ".join(NEUTRAL + POSITIVE + NEGATIVE)]


def write_tiny_checkpoint(directory: Path, *, seed: int) -> None:
    """A random 2-layer causal-LM Qwen3 (hidden 64) with a word-level ``tokenizer.json``."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS)
    tokenizer.train_from_iterator(vocabulary_texts(), trainer)
    vocab = tokenizer.get_vocab_size()
    config = Qwen3DenseConfig(
        model_type="qwen3",
        vocab_size=max(128, (vocab + 63) // 64 * 64),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.token_to_id("<pad>"),
        eos_token_id=tokenizer.token_to_id("<eos>"),
    )
    torch.manual_seed(seed)
    model = DecoderCausalLM(config)
    model.reset_parameters()
    staging = directory.parent / f".{directory.name}.partial"
    d9d.hf.save_pretrained(model, staging)
    tokenizer.save(str(staging / "tokenizer.json"))
    staging.rename(directory)  # complete or absent: a rerun never finds half a checkpoint
