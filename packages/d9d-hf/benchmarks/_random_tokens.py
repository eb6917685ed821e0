"""The benchmarks' data: random token rows, the same for every implementation and run."""

from __future__ import annotations

from typing import Any

import torch


class RandomTokens:
    """A map-style dataset of random rows (a new row per index, seeded)."""

    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        self._rows, self._seq, self._vocab = rows, seq, vocab

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index: int) -> Any:
        from d9d.hf import TokenSample

        generator = torch.Generator().manual_seed(index)
        return TokenSample(input_ids=torch.randint(0, self._vocab, (self._seq,), generator=generator))
