"""The benchmarks' data: random token rows, the same for every implementation and run."""

from __future__ import annotations

from typing import Any

import torch


class RandomTokens:
    """A map-style dataset of random rows (a new row per index, seeded).

    With ``documents`` above 1 every row packs that many equal documents (``document_ids``), so
    attention stays within each, as in a packed fine-tuning batch.
    """

    def __init__(self, rows: int, seq: int, vocab: int, *, documents: int = 1) -> None:
        self._rows, self._seq, self._vocab, self._documents = rows, seq, vocab, documents

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index: int) -> Any:
        from d9d.hf import TokenSample

        generator = torch.Generator().manual_seed(index)
        input_ids = torch.randint(0, self._vocab, (self._seq,), generator=generator)
        if self._documents == 1:
            return TokenSample(input_ids=input_ids)
        document_ids = torch.arange(self._seq) * self._documents // self._seq
        return TokenSample(input_ids=input_ids, document_ids=document_ids)
