"""Binary AUROC: exact (every score kept and gathered) or binned (two histograms, summed)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed import ProcessGroup

from d9d.loop.metrics._metric import SummedStateMetric, check_labels, distributed, raise_if_bad
from d9d.mesh import all_gather_variable_shape

_F64 = torch.float64


def exact_auroc(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The area under the ROC curve, ties counted half (equals scikit-learn's ``roc_auc_score``).

    Mann-Whitney: ``(sum of the positives' average ranks - P(P+1)/2) / (P * N)``; 0.5 when one
    class is absent (the curve is undefined there).
    """
    n = scores.numel()
    positives = target.to(_F64).sum()
    negatives = n - positives
    if n == 0 or positives == 0 or negatives == 0:
        return torch.tensor(0.5, dtype=_F64, device=scores.device)
    sorted_scores, order = torch.sort(scores.to(_F64))
    starts_group = torch.ones(n, dtype=torch.bool, device=scores.device)
    starts_group[1:] = sorted_scores[1:] != sorted_scores[:-1]
    inverse = torch.cumsum(starts_group.long(), 0) - 1  # tie group of each sorted score
    counts = torch.bincount(inverse)
    ends = torch.cumsum(counts, 0).to(_F64)
    average_rank = ends - (counts.to(_F64) - 1) / 2  # 1-based average rank of each tie group
    ranks = average_rank[inverse]
    positive_ranks = (ranks * target[order].to(_F64)).sum()
    return (positive_ranks - positives * (positives + 1) / 2) / (positives * negatives)


class BinaryAUROC(SummedStateMetric):
    """Area under the ROC curve of binary scores.

    Args:
        bins: None: exact (keeps every score; ``sync`` gathers them, memory grows with the data).
            An integer: binned (scores in [0, 1] fall into ``bins`` equal bins; fixed memory,
            ``sync`` is one all-reduce; scores of one bin count as ties, so the error is at most
            the share of positive/negative pairs that fall into one bin).
    """

    def __init__(self, *, bins: int | None = None) -> None:
        super().__init__()
        if bins is not None and bins < 2:
            raise ValueError(f"BinaryAUROC bins={bins} must be >= 2 (or None for the exact AUROC)")
        self._bins = bins
        self._add_state("bad", torch.zeros((), dtype=torch.int64))
        if bins is not None:
            self._add_state("positive", torch.zeros(bins, dtype=_F64))
            self._add_state("negative", torch.zeros(bins, dtype=_F64))
        self._scores: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, scores: torch.Tensor, target: torch.Tensor) -> None:
        """Adds scores (any real for exact, probabilities for binned) and 0/1 targets of one shape."""
        scores, target = scores.detach().reshape(-1), target.detach().reshape(-1).long()
        if scores.shape != target.shape:
            raise ValueError(f"BinaryAUROC got {scores.numel()} scores but {target.numel()} targets")
        self._accumulate("bad", check_labels("BinaryAUROC", target, 0, 2))
        self._gathered = None
        if self._bins is None:
            self._scores.append(scores.float())
            self._targets.append(target.to(torch.uint8))
            return
        index = (scores.float().clamp(0, 1) * self._bins).long().clamp(max=self._bins - 1)
        is_positive = (target == 1).to(_F64)
        self._accumulate(
            "positive",
            torch.zeros(self._bins, dtype=_F64, device=scores.device).index_add_(0, index, is_positive),
        )
        self._accumulate(
            "negative",
            torch.zeros(self._bins, dtype=_F64, device=scores.device).index_add_(0, index, 1 - is_positive),
        )

    def _local(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._scores:
            return torch.zeros(0), torch.zeros(0, dtype=torch.uint8)
        return torch.cat(self._scores), torch.cat(self._targets)

    def sync(self, group: ProcessGroup | None) -> None:
        """Sums the histograms (binned), or gathers every rank's scores (exact)."""
        super().sync(group)
        if self._bins is None:
            scores, targets = self._local()
            if distributed(group):
                scores = torch.cat(all_gather_variable_shape(scores, group))
                targets = torch.cat(all_gather_variable_shape(targets, group))
            self._gathered = (scores, targets)

    def compute(self) -> torch.Tensor:
        """The AUROC (0.5 when one class is absent)."""
        raise_if_bad("BinaryAUROC", self._value("bad"), 0, 2)
        if self._bins is None:
            scores, targets = self._gathered if self._gathered is not None else self._local()
            return exact_auroc(scores, targets)
        positive, negative = self._value("positive"), self._value("negative")
        total_positive, total_negative = positive.sum(), negative.sum()
        if total_positive == 0 or total_negative == 0:
            return torch.tensor(0.5, dtype=_F64, device=positive.device)
        negatives_below = torch.cumsum(negative, 0) - negative
        pairs = (positive * (negatives_below + negative / 2)).sum()
        return pairs / (total_positive * total_negative)

    def reset(self) -> None:
        """Forgets every score."""
        super().reset()
        self._scores, self._targets, self._gathered = [], [], None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The histograms (binned) or this rank's scores and targets (exact)."""
        state = super().state_dict()
        if self._bins is None:
            state["scores"], state["targets"] = self._local()
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restores what ``state_dict`` returned."""
        super().load_state_dict(state)
        if self._bins is None:
            self._scores, self._targets = [state["scores"].clone()], [state["targets"].clone()]
        self._gathered = None
