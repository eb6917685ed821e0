"""Token rows and the two ways to batch them: stack fixed-length rows, or pad to the longest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(kw_only=True)
class TokenRow:
    """One training row before batching (Python lists, cheap to build and to pickle).

    Attributes:
        input_ids: Token ids.
        labels: Hugging Face style labels (``labels[t]`` is token ``t``), ``-100`` where no loss
            is wanted.
        document_ids: Which packed sample each token belongs to (None: the row is one sample).
        where: The first sample's origin (``file:line``), for messages.
    """

    input_ids: list[int]
    labels: list[int]
    document_ids: list[int] | None = None
    where: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(kw_only=True)
class RowBatch:
    """Rows of one length, each tensor ``(batch, seq)``.

    Attributes:
        input_ids: Token ids (padding is ``pad_id``).
        labels: ``-100`` on padding and wherever no loss is wanted.
        attention_mask: 1 on real tokens, 0 on padding.
        document_ids: Packed documents (padding is a document of its own); None when not packed.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    document_ids: torch.Tensor | None = None


def stack_rows(rows: list[TokenRow]) -> RowBatch:
    """Batches rows that all have one length (packed rows).

    Raises:
        ValueError: If the lengths differ, or some rows are packed and others not.
    """
    lengths = {len(row) for row in rows}
    if len(lengths) != 1:
        raise ValueError(f"stack_rows needs rows of one length, got lengths {sorted(lengths)}")
    documents = [row.document_ids for row in rows]
    if any(d is None for d in documents) and not all(d is None for d in documents):
        raise ValueError("some rows have document_ids and others do not")
    ids = torch.tensor([row.input_ids for row in rows], dtype=torch.long)
    return RowBatch(
        input_ids=ids,
        labels=torch.tensor([row.labels for row in rows], dtype=torch.long),
        attention_mask=torch.ones_like(ids),
        document_ids=None if documents[0] is None else torch.tensor(documents, dtype=torch.long),
    )


class PaddingCollator:
    """Pads rows on the right to the longest row of the batch, rounded up to a multiple.

    Args:
        pad_id: The token id of padding.
        multiple_of: Round the padded length up to a multiple of this (8 suits tensor cores).
        length: Pad every batch to exactly this length instead (fixed shapes, e.g. for pipeline
            parallelism); None pads to the batch's longest row.
    """

    def __init__(self, *, pad_id: int, multiple_of: int = 1, length: int | None = None) -> None:
        if multiple_of < 1:
            raise ValueError(f"multiple_of must be at least 1, got {multiple_of}")
        self._pad_id = pad_id
        self._multiple_of = multiple_of
        self._length = length

    def padded_length(self, rows: list[TokenRow]) -> int:
        """The length this collator pads ``rows`` to."""
        if self._length is not None:
            return self._length
        longest = max(len(row) for row in rows)
        return -(-longest // self._multiple_of) * self._multiple_of

    def __call__(self, rows: list[TokenRow]) -> RowBatch:
        length = self.padded_length(rows)
        ids = torch.full((len(rows), length), self._pad_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row)
            if n > length:
                raise ValueError(f"{row.where}: row of {n} tokens is longer than the padded length {length}")
            ids[i, :n] = torch.tensor(row.input_ids, dtype=torch.long)
            labels[i, :n] = torch.tensor(row.labels, dtype=torch.long)
            mask[i, :n] = 1
        return RowBatch(input_ids=ids, labels=labels, attention_mask=mask)
