"""Precision, recall and F-beta from confusion counts: binary, multiclass (top-k), multilabel."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from d9d.loop.metrics._metric import SummedStateMetric, check_labels, raise_if_bad, safe_divide

_F64 = torch.float64

Average = Literal["micro", "macro", "weighted", "none"]
"""How per-class scores combine: ``micro`` (pool the counts of all classes), ``macro`` (mean of
the per-class scores), ``weighted`` (mean weighted by each class's support), ``none`` (one value
per class)."""


class _ConfusionScores(SummedStateMetric):
    """True/false positives and false negatives per class; scores as scikit-learn computes them."""

    def __init__(self, *, name: str, classes: int, average: Average, beta: float) -> None:
        super().__init__()
        if beta <= 0:
            raise ValueError(f"{name} beta={beta} must be > 0")
        self._name, self._classes, self._average, self._beta = name, classes, average, beta
        for state in ("tp", "fp", "fn"):
            self._add_state(state, torch.zeros(classes, dtype=_F64))
        self._add_state("bad", torch.zeros((), dtype=torch.int64))

    def _add_counts(self, predicted: torch.Tensor, actual: torch.Tensor) -> None:
        """Adds multi-hot ``[N, classes]`` predictions and truths."""
        predicted, actual = predicted.bool(), actual.bool()
        self._accumulate("tp", (predicted & actual).sum(0))
        self._accumulate("fp", (predicted & ~actual).sum(0))
        self._accumulate("fn", (~predicted & actual).sum(0))

    def compute(self) -> dict[str, torch.Tensor]:
        """``precision``, ``recall`` and ``f1`` (``fbeta`` when beta != 1), averaged as configured."""
        raise_if_bad(self._name, self._value("bad"), 0, self._classes)
        tp, fp, fn = self._value("tp"), self._value("fp"), self._value("fn")
        if self._average == "micro":
            tp, fp, fn = tp.sum(), fp.sum(), fn.sum()
        precision = safe_divide(tp, tp + fp)
        recall = safe_divide(tp, tp + fn)
        b2 = self._beta**2
        fbeta = safe_divide((1 + b2) * tp, (1 + b2) * tp + b2 * fn + fp)
        scores = {"precision": precision, "recall": recall, "f1" if self._beta == 1 else "fbeta": fbeta}
        match self._average:
            case "micro" | "none":
                return scores
            case "macro":
                return {k: v.mean() for k, v in scores.items()}
            case "weighted":
                support = tp + fn
                return {k: safe_divide((v * support).sum(), support.sum()) for k, v in scores.items()}
            case _:
                raise ValueError(f"{self._name} average={self._average!r} is not one of {Average}")


class BinaryScores(_ConfusionScores):
    """Precision, recall and F-beta of the positive class; ``preds >= threshold`` predicts it.

    ``update(preds, target)``: probabilities (or any scores with a matching threshold) and 0/1
    targets of one shape.
    """

    def __init__(self, *, threshold: float = 0.5, beta: float = 1.0) -> None:
        super().__init__(name="BinaryScores", classes=1, average="micro", beta=beta)
        self._threshold = threshold

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Adds a batch."""
        target = target.detach().reshape(-1).long()
        self._accumulate("bad", check_labels(self._name, target, 0, 2))
        predicted = (preds.detach().reshape(-1) >= self._threshold).unsqueeze(1)
        self._add_counts(predicted, (target == 1).unsqueeze(1))


class MulticlassScores(_ConfusionScores):
    """Precision, recall and F-beta over ``num_classes`` classes.

    ``update(preds, target)``: ``preds`` of shape ``[N, num_classes]`` (scores) and integer
    ``target`` of shape ``[N]``. With ``top_k > 1`` a sample predicts its target when the target is
    among its ``k`` highest classes, else its highest class (as torchmetrics does).
    """

    def __init__(
        self, *, num_classes: int, top_k: int = 1, average: Average = "macro", beta: float = 1.0
    ) -> None:
        if not 1 <= top_k <= num_classes:
            raise ValueError(f"MulticlassScores top_k={top_k} must be in [1, num_classes={num_classes}]")
        super().__init__(name="MulticlassScores", classes=num_classes, average=average, beta=beta)
        self._top_k = top_k

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Adds a batch."""
        preds, target = preds.detach(), target.detach().reshape(-1).long()
        if preds.ndim != 2 or preds.shape != (target.numel(), self._classes):
            raise ValueError(
                f"MulticlassScores expects preds of shape [N, {self._classes}] for {target.numel()} "
                f"targets, got {tuple(preds.shape)}"
            )
        self._accumulate("bad", check_labels(self._name, target, 0, self._classes))
        safe_target = target.clamp(0, self._classes - 1)
        top = preds.topk(self._top_k, dim=1).indices
        hit = (top == safe_target.unsqueeze(1)).any(dim=1)
        predicted_class = torch.where(hit, safe_target, top[:, 0])
        predicted = F.one_hot(predicted_class, self._classes).bool()
        actual = F.one_hot(safe_target, self._classes).bool()
        self._add_counts(predicted, actual)


class MultilabelScores(_ConfusionScores):
    """Precision, recall and F-beta over ``num_labels`` independent labels.

    ``update(preds, target)``: ``preds`` (probabilities) and 0/1 ``target``, both ``[N, num_labels]``.
    """

    def __init__(
        self, *, num_labels: int, threshold: float = 0.5, average: Average = "macro", beta: float = 1.0
    ) -> None:
        super().__init__(name="MultilabelScores", classes=num_labels, average=average, beta=beta)
        self._threshold = threshold

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Adds a batch."""
        preds, target = preds.detach(), target.detach().long()
        if preds.shape != target.shape or preds.ndim != 2 or preds.shape[1] != self._classes:
            raise ValueError(
                f"MultilabelScores expects preds and target of shape [N, {self._classes}], got "
                f"{tuple(preds.shape)} and {tuple(target.shape)}"
            )
        self._accumulate("bad", check_labels(self._name, target, 0, 2))
        self._add_counts(preds >= self._threshold, target == 1)
