"""Preference pairs laid out for training: chosen and rejected rows interleaved, reference scores beside."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from d9d.hf import causal_lm_targets
from d9d.hf.data import PreferencePair
from d9d.loop.data import IGNORE_INDEX, PaddingCollator, TokenRow


@dataclass(kw_only=True, frozen=True)
class ReferenceScore:
    """The reference model's summed log-probability of a pair's two answers (their answer tokens).

    Attributes:
        chosen: Of the chosen answer.
        rejected: Of the rejected answer.
    """

    chosen: float
    rejected: float


@dataclass(kw_only=True)
class DPOBatch:
    """Pairs as rows: row ``2i`` is pair ``i``'s chosen answer, row ``2i + 1`` its rejected one.

    Interleaving keeps both answers of a pair in one microbatch whatever the number of
    microbatches (each holds an even number of rows when the pairs divide evenly).

    Attributes:
        input_ids: ``(2 * pairs, seq)`` prompt then answer, right-padded.
        targets: ``(2 * pairs, seq)`` the token position ``t`` should predict where it is an
            answer token, ``-100`` elsewhere (prompt, padding).
        ref_log_probs: ``(2 * pairs,)`` the reference model's summed log-probability of each
            row's answer tokens, scored before training; None when a colocated reference scores
            them in the step (``DPOTask(reference=...)``).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    ref_log_probs: torch.Tensor | None = None


def _rows(pairs: Sequence[PreferencePair]) -> list[TokenRow]:
    return [row for pair in pairs for row in (pair.chosen, pair.rejected)]


def preference_rows(pairs: Sequence[PreferencePair], *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, targets)`` of ``pairs``, chosen and rejected rows interleaved and right-padded."""
    rows = PaddingCollator(pad_id=pad_id)(_rows(pairs))
    return rows.input_ids, causal_lm_targets(rows.labels, ignore_index=IGNORE_INDEX)


def collate_pairs(
    pairs: Sequence[PreferencePair], scores: Sequence[ReferenceScore] | None, *, pad_id: int
) -> DPOBatch:
    """A ``DPOBatch`` of ``pairs`` with their reference scores (in the same order; None: without).

    Raises:
        ValueError: If there are no pairs or the scores do not match them one to one.
    """
    if not pairs or (scores is not None and len(scores) != len(pairs)):
        count = "no" if scores is None else len(scores)
        raise ValueError(f"{len(pairs)} pairs and {count} reference scores: need one score per pair")
    input_ids, targets = preference_rows(pairs, pad_id=pad_id)
    if scores is None:
        return DPOBatch(input_ids=input_ids, targets=targets)
    ref = torch.tensor([v for s in scores for v in (s.chosen, s.rejected)], dtype=torch.float32)
    return DPOBatch(input_ids=input_ids, targets=targets, ref_log_probs=ref)
