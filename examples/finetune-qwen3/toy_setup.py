"""When no checkpoint or data is given: a toy SFT set and a tiny random Qwen3 that fits it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import d9d.hf
from d9d.hf.qwen3 import Qwen3CausalLM, Qwen3DenseConfig

SPECIAL_TOKENS = ["<pad>", "<unk>", "<eos>"]
CAPITALS = {
    "france": "paris", "italy": "rome", "spain": "madrid", "germany": "berlin", "japan": "tokyo",
    "egypt": "cairo", "peru": "lima", "kenya": "nairobi", "norway": "oslo", "chile": "santiago",
    "cuba": "havana", "greece": "athens", "poland": "warsaw", "austria": "vienna", "ireland": "dublin",
    "portugal": "lisbon", "sweden": "stockholm", "finland": "helsinki", "china": "beijing", "india": "delhi",
}  # fmt: skip
TEMPLATES = [
    "what is the capital of {} ?",
    "name the capital city of {} .",
    "tell me the capital of {} please",
    "{} has which capital ?",
]


def write_toy_pairs(path: Path, *, seed: int) -> None:
    """Writes prompt/completion JSONL: each country's capital asked in every template, shuffled."""
    pairs = [
        {"prompt": template.format(country), "completion": capital}
        for country, capital in CAPITALS.items()
        for template in TEMPLATES
    ]
    random.Random(seed).shuffle(pairs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A whitespace word-level tokenizer of ``texts`` (the tiny checkpoint's ``tokenizer.json``)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    return tokenizer


def write_tiny_checkpoint(directory: Path, *, texts: list[str], seed: int) -> None:
    """A random 2-layer Qwen3 (hidden 64) saved with d9d.hf, plus its ``tokenizer.json``."""
    tokenizer = train_tokenizer(texts)
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
    model = Qwen3CausalLM(config)
    model.reset_parameters()
    staging = directory.parent / f".{directory.name}.partial"
    d9d.hf.save_pretrained(model, staging)
    tokenizer.save(str(staging / "tokenizer.json"))
    staging.rename(directory)  # complete or absent: a rerun never finds half a checkpoint
