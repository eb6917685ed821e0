"""Preference pairs for a reward model: checked before training, batched as interleaved rows."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class TokenIds(Protocol):
    """One side of a pair as tokens (d9d-loop's ``TokenRow`` fits)."""

    @property
    def input_ids(self) -> Sequence[int]:
        """Its token ids."""
        ...


class PreferenceLike(Protocol):
    """A tokenized preference pair (d9d-hf's ``PreferencePair`` reader output fits)."""

    @property
    def chosen(self) -> TokenIds:
        """The preferred sequence (prompt and answer)."""
        ...

    @property
    def rejected(self) -> TokenIds:
        """The dispreferred sequence."""
        ...


@dataclass(kw_only=True, frozen=True)
class RewardPair:
    """One pair, each side ``(length,)`` token ids ending at the token its reward is read at.

    Attributes:
        chosen: The preferred sequence.
        rejected: The dispreferred sequence.
    """

    chosen: torch.Tensor
    rejected: torch.Tensor


def _scored_ids(ids: Sequence[int], pad_token_id: int, *, row: int, side: str) -> torch.Tensor:
    """``ids`` up to their last token that is not padding (where transformers reads the score)."""
    tokens = torch.as_tensor(list(ids), dtype=torch.int64)
    real = (tokens != pad_token_id).nonzero().flatten()
    if real.numel() == 0:
        raise ValueError(
            f"preference row {row}: its {side!r} side has no token other than pad_token_id={pad_token_id} "
            "(the reward is read at the last one)"
        )
    return tokens[: int(real[-1]) + 1]


class RewardPairs:
    """A map-style dataset of ``RewardPair``, every row checked when it is built (before training).

    Each side keeps its tokens up to its last one that is not ``pad_token_id``: transformers'
    ``*ForSequenceClassification`` reads the score there, so trailing pad-id tokens (an end token
    that doubles as padding) change nothing and are left out.

    Args:
        pairs: Tokenized pairs (``PreferenceLike``: ``.chosen.input_ids``, ``.rejected.input_ids``).
        pad_token_id: The model's padding token id.

    Raises:
        ValueError: Naming the first row (its position in ``pairs``) with a side that has no token
            other than padding.
    """

    def __init__(self, pairs: Sequence[PreferenceLike], *, pad_token_id: int) -> None:
        self._pairs = [
            RewardPair(
                chosen=_scored_ids(pair.chosen.input_ids, pad_token_id, row=row, side="chosen"),
                rejected=_scored_ids(pair.rejected.input_ids, pad_token_id, row=row, side="rejected"),
            )
            for row, pair in enumerate(pairs)
        ]

    @classmethod
    def from_records(
        cls,
        records: Sequence[Mapping[str, Any]],
        encode: Callable[[Any], Sequence[int]],
        *,
        pad_token_id: int,
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
    ) -> RewardPairs:
        """Pairs of ``encode(record[chosen_field])`` and ``encode(record[rejected_field])``.

        Args:
            records: Preference rows (e.g. parsed JSONL lines).
            encode: Token ids of a field's value (text, or messages through a chat template).
            pad_token_id: The model's padding token id.
            chosen_field: The preferred answer's key.
            rejected_field: The dispreferred answer's key.

        Raises:
            ValueError: Naming the first row whose chosen or rejected field is missing, null or
                empty, or that has no token other than padding; no row is encoded before every
                row's fields are checked.
        """
        for row, record in enumerate(records):
            for key in (chosen_field, rejected_field):
                value = record.get(key)
                if value is None or (isinstance(value, str | list | tuple | dict) and not value):
                    raise ValueError(f"preference row {row} has no {key!r} (a reward pair needs both sides)")
        encoded = [
            _EncodedPair(
                chosen=_Ids(input_ids=encode(r[chosen_field])),
                rejected=_Ids(input_ids=encode(r[rejected_field])),
            )
            for r in records
        ]
        return cls(encoded, pad_token_id=pad_token_id)

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, index: int) -> RewardPair:
        return self._pairs[index]


@dataclass(kw_only=True, frozen=True)
class _Ids:
    input_ids: Sequence[int]


@dataclass(kw_only=True, frozen=True)
class _EncodedPair:
    chosen: _Ids
    rejected: _Ids


@dataclass(kw_only=True)
class RewardBatch:
    """Pairs as interleaved rows: row ``2i`` is pair ``i``'s chosen side, row ``2i + 1`` its rejected.

    Interleaving keeps every pair whole when the loop splits the rows into microbatches.

    Attributes:
        input_ids: ``(2 * pairs, seq)`` token ids, right-padded.
        attention_mask: ``(2 * pairs, seq)``, 1 on each row's tokens up to its scored one.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @staticmethod
    def collator(pad_token_id: int) -> Callable[[list[RewardPair]], RewardBatch]:
        """A collator for ``AutoDataProvider`` that right-pads with ``pad_token_id``."""

        def collate(pairs: list[RewardPair]) -> RewardBatch:
            rows = [side for pair in pairs for side in (pair.chosen, pair.rejected)]
            length = max(row.numel() for row in rows)
            input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.int64)
            attention_mask = torch.zeros((len(rows), length), dtype=torch.int64)
            for index, row in enumerate(rows):
                input_ids[index, : row.numel()] = row
                attention_mask[index, : row.numel()] = 1
            return RewardBatch(input_ids=input_ids, attention_mask=attention_mask)

        return collate
