"""Prompt/completion pairs from JSONL, tokenized and packed into fixed-length rows for SFT."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from d9d.hf import TokenSample

IGNORE_INDEX = -100


@dataclass(kw_only=True, frozen=True)
class Pair:
    prompt: str
    completion: str


def read_pairs(path: Path) -> list[Pair]:
    """Reads ``{"prompt": ..., "completion": ...}`` lines; errors name the file and line."""
    pairs: list[Pair] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            pairs.append(Pair(prompt=str(record["prompt"]), completion=str(record["completion"])))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a {{prompt, completion}} object: {error}") from error
    if not pairs:
        raise ValueError(f"{path}: no prompt/completion pairs")
    return pairs


def split_pairs(pairs: list[Pair], *, eval_fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """A seeded shuffle, then the last ``eval_fraction`` held out (at least one pair)."""
    shuffled = list(pairs)
    random.Random(seed).shuffle(shuffled)
    held_out = max(1, round(len(shuffled) * eval_fraction))
    return shuffled[:-held_out], shuffled[-held_out:]


def _encode(tokenizer: Tokenizer, pair: Pair, eos_id: int) -> tuple[list[int], list[int]]:
    prompt = tokenizer.encode(pair.prompt, add_special_tokens=False).ids
    completion = [*tokenizer.encode(" " + pair.completion, add_special_tokens=False).ids, eos_id]
    return prompt + completion, [IGNORE_INDEX] * len(prompt) + completion


def pack(
    pairs: list[Pair], tokenizer: Tokenizer, *, sequence_length: int, eos_id: int, pad_id: int
) -> list[TokenSample]:
    """Packs encoded pairs greedily into rows; each pair is its own document, padding has no loss.

    The loss falls on completions only (prompt labels are ``-100``); attention and positions
    restart per document. A pair longer than a row is truncated.
    """
    rows: list[TokenSample] = []
    ids: list[int] = []
    labels: list[int] = []
    documents: list[int] = []

    def flush() -> None:
        padding = sequence_length - len(ids)
        rows.append(
            TokenSample(
                input_ids=torch.tensor(ids + [pad_id] * padding),
                labels=torch.tensor(labels + [IGNORE_INDEX] * padding),
                document_ids=torch.tensor(documents + [len(set(documents))] * padding),
            )
        )
        ids.clear()
        labels.clear()
        documents.clear()

    for pair in pairs:
        pair_ids, pair_labels = _encode(tokenizer, pair, eos_id)
        pair_ids, pair_labels = pair_ids[:sequence_length], pair_labels[:sequence_length]
        if len(ids) + len(pair_ids) > sequence_length:
            flush()
        document = len(set(documents))
        ids += pair_ids
        labels += pair_labels
        documents += [document] * len(pair_ids)
    if ids:
        flush()
    return rows


class PackedRows:
    """A map-style dataset of packed rows (``AutoDataProvider`` shards and orders it)."""

    def __init__(self, rows: list[TokenSample]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> TokenSample:
        return self._rows[index]
