"""When no checkpoint or data is given: a toy SFT set and a tiny random Qwen3 that fits it.

The tiny checkpoint carries a ChatML ``chat_template`` in its ``tokenizer_config.json``, so the
same job runs on a chat JSONL file (``dataset: {source: chats.jsonl, format: chat}``) too.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import d9d.hf
from d9d.hf import DecoderCausalLM
from d9d.hf.qwen3 import Qwen3DenseConfig

SPECIAL_TOKENS = ["<pad>", "<unk>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
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
    """Writes prompt/completion JSONL: each country's capital asked in every template, shuffled.

    Says where, and which folders it created: a mistyped ``dataset.source`` with
    ``finetune.toy_data: true`` would otherwise train on the toy set without a word.
    """
    pairs = [
        {"prompt": template.format(country), "completion": capital}
        for country, capital in CAPITALS.items()
        for template in TEMPLATES
    ]
    random.Random(seed).shuffle(pairs)
    target = path.absolute()
    created = [folder for folder in reversed(target.parents) if not folder.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    # Under torchrun every rank that found it missing writes it: each its own file, moved into
    # place whole, so no rank reads a file another one is rewriting.
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex}.partial"
    staging.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    staging.replace(target)
    folders = f", creating {', '.join(str(f) for f in created)}" if created else ""
    print(
        f"finetune.toy_data: {path} did not exist: wrote the toy set ({len(pairs)} pairs) to {target}"
        f"{folders}; set finetune.toy_data: false to train on your own file",
        file=sys.stderr,
    )


def record_texts(path: Path) -> list[str]:
    """The words of a JSONL data file's string fields and messages, to train the toy tokenizer on.

    Lines that are not JSON objects are passed over here: reading the data reports them.
    """
    texts: list[str] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        for value in cast(dict[str, Any], record).values():
            if isinstance(value, str):
                texts.append(value)
            elif isinstance(value, list):
                messages: list[dict[str, Any]] = [m for m in cast(list[Any], value) if isinstance(m, dict)]
                texts += [f"{m.get('role', '')} {m.get('content', '')}" for m in messages]
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A whitespace word-level tokenizer of ``texts`` (the tiny checkpoint's ``tokenizer.json``)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    return tokenizer


def write_tiny_checkpoint(directory: Path, *, texts: list[str], seed: int) -> None:
    """A random 2-layer Qwen3 (hidden 64) saved with d9d.hf, plus its ``tokenizer.json``.

    Under torchrun every rank that found ``directory`` missing writes one (the same: same texts,
    same seed), each in a staging folder of its own; the first to finish puts it in place and the
    others drop theirs.
    """
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
    model = DecoderCausalLM(config)
    model.reset_parameters()
    staging = directory.parent / f".{directory.name}.{uuid.uuid4().hex}.partial"  # unique across nodes
    d9d.hf.save_pretrained(model, staging)
    tokenizer.save(str(staging / "tokenizer.json"))
    tokenizer_config = {
        # tokenizer.json as it is: without a class, AutoTokenizer would rebuild Qwen2's BPE from its
        # word-level vocabulary (config.json says qwen3) and read a prompt as one unknown token
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": CHATML,
    }
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    try:
        staging.rename(directory)  # complete or absent: a rerun never finds half a checkpoint
    except OSError:
        if not directory.is_dir():
            raise
        shutil.rmtree(staging)  # another rank's checkpoint is in place already
