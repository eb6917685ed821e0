"""Sums, weighted means, perplexity and accuracy: metrics of a few summed scalars."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from d9d.loop.metrics._metric import SummedStateMetric, check_labels, raise_if_bad, safe_divide
from d9d.loop.step._device_scalars import device_scalar

_F64 = torch.float64


class SumMetric(SummedStateMetric):
    """The sum of every value added."""

    def __init__(self) -> None:
        super().__init__()
        self._add_state("sum", torch.zeros((), dtype=_F64))

    def update(self, value: torch.Tensor | float) -> None:
        """Adds the sum of ``value``'s elements."""
        self._accumulate("sum", torch.as_tensor(value).detach().to(_F64).sum())

    def compute(self) -> torch.Tensor:
        """The total."""
        return self._value("sum")


class WeightedMean(SummedStateMetric):
    """``sum(weight * value) / sum(weight)`` over everything added (0 when no weight was added)."""

    def __init__(self) -> None:
        super().__init__()
        self._add_state("weighted_sum", torch.zeros((), dtype=_F64))
        self._add_state("weight", torch.zeros((), dtype=_F64))

    def update(self, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        """Adds ``value`` (any shape) with ``weight`` (broadcast to ``value``'s shape)."""
        v = torch.as_tensor(value).detach().to(_F64)
        weight_t = (
            weight.detach().to(device=v.device, dtype=_F64)
            if isinstance(weight, torch.Tensor)
            else device_scalar(weight, device=v.device, dtype=_F64)
        )
        w = torch.broadcast_to(weight_t, v.shape)
        self._accumulate("weighted_sum", (v * w).sum())
        self._accumulate("weight", w.sum())

    def compute(self) -> torch.Tensor:
        """The weighted mean."""
        return safe_divide(self._value("weighted_sum"), self._value("weight"))


class Perplexity(SummedStateMetric):
    """``exp`` of the mean token negative log-likelihood (as torchmetrics' ``Perplexity``).

    Args:
        ignore_index: Target value of tokens left out (padding, prompt tokens).
    """

    def __init__(self, ignore_index: int | None = -100) -> None:
        super().__init__()
        self._ignore_index = ignore_index
        self._add_state("nll", torch.zeros((), dtype=_F64))
        self._add_state("tokens", torch.zeros((), dtype=_F64))
        self._add_state("bad", torch.zeros((), dtype=torch.int64))
        self._vocab = 0

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Adds tokens: ``logits`` of shape ``[..., vocab]``, ``target`` of shape ``[...]``."""
        vocab = logits.shape[-1]
        self._vocab = vocab
        flat_logits, flat_target = logits.detach().reshape(-1, vocab), target.reshape(-1)
        keep = (
            flat_target != self._ignore_index
            if self._ignore_index is not None
            else torch.ones_like(flat_target, dtype=torch.bool)
        )
        self._accumulate("bad", check_labels("Perplexity", flat_target[keep], 0, vocab))
        safe_target = torch.where(keep, flat_target, 0).clamp(0, vocab - 1)
        nll = F.cross_entropy(flat_logits.float(), safe_target, reduction="none")
        self._accumulate("nll", (nll.to(_F64) * keep).sum())
        self._accumulate("tokens", keep.sum())

    def compute(self) -> torch.Tensor:
        """The perplexity."""
        raise_if_bad("Perplexity", self._value("bad"), 0, self._vocab)
        return torch.exp(safe_divide(self._value("nll"), self._value("tokens")))


class Accuracy(SummedStateMetric):
    """The fraction of samples predicted right (micro accuracy).

    ``update(preds, target)`` with ``preds`` of shape ``[N, C]`` (scores of ``C`` classes; right
    when the target is among the ``top_k`` highest) or ``[N]`` (binary probabilities, right when
    ``preds >= threshold`` equals the 0/1 target).
    """

    def __init__(self, *, top_k: int = 1, threshold: float = 0.5) -> None:
        super().__init__()
        if top_k < 1:
            raise ValueError(f"Accuracy top_k={top_k} must be >= 1")
        self._top_k = top_k
        self._threshold = threshold
        self._classes = 2
        self._add_state("correct", torch.zeros((), dtype=_F64))
        self._add_state("total", torch.zeros((), dtype=_F64))
        self._add_state("bad", torch.zeros((), dtype=torch.int64))

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Adds a batch."""
        preds, target = preds.detach(), target.detach().long()
        if preds.ndim == target.ndim + 1:
            self._classes = preds.shape[-1]
            if self._top_k > self._classes:
                raise ValueError(f"Accuracy top_k={self._top_k} exceeds the {self._classes} classes")
            self._accumulate("bad", check_labels("Accuracy", target, 0, self._classes))
            top = preds.topk(self._top_k, dim=-1).indices
            correct = (top == target.unsqueeze(-1)).any(dim=-1)
        else:
            self._accumulate("bad", check_labels("Accuracy", target, 0, 2))
            correct = (preds >= self._threshold).long() == target
        self._accumulate("correct", correct.sum())
        self._accumulate("total", device_scalar(correct.numel(), device=correct.device, dtype=_F64))

    def compute(self) -> torch.Tensor:
        """The accuracy."""
        raise_if_bad("Accuracy", self._value("bad"), 0, self._classes)
        return safe_divide(self._value("correct"), self._value("total"))
