"""Direct preference losses: DPO's sigmoid loss (with label smoothing) and IPO's squared loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

PreferenceLoss = Literal["sigmoid", "ipo"]
"""Which preference loss of the margin ``h = (pi_c - ref_c) - (pi_r - ref_r)``.

``sigmoid``: DPO (Rafailov et al. 2023, eq. 7), ``-logsigmoid(beta h)``; with label smoothing
``eps`` the conservative DPO of Mitchell (2023), ``-(1 - eps) logsigmoid(beta h) - eps
logsigmoid(-beta h)``. Log-probs are summed over each answer's tokens. ``ipo``: IPO (Azar et al.
2023, eq. 17), ``(h - 1 / (2 beta))^2``, with log-probs averaged over each answer's tokens as TRL's
``DPOTrainer`` does.
"""


class DPOLossConfig(BaseModel):
    """The preference objective's constants.

    Attributes:
        loss: See ``PreferenceLoss``.
        beta: The strength of the tie to the reference (DPO's beta, IPO's tau).
        label_smoothing: The assumed share of flipped labels (``sigmoid`` only; 0 is plain DPO).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss: PreferenceLoss = "sigmoid"
    beta: float = Field(default=0.1, gt=0.0)
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)

    @model_validator(mode="after")
    def _smoothing_is_sigmoids(self) -> DPOLossConfig:
        if self.loss == "ipo" and self.label_smoothing != 0:
            raise ValueError(
                f"label_smoothing={self.label_smoothing} applies to loss 'sigmoid' only, not 'ipo'"
            )
        return self


@dataclass(kw_only=True, frozen=True)
class DPOLossResult:
    """A preference loss over some pairs, and the implicit rewards it reports.

    Attributes:
        loss: The mean loss over the pairs (to minimize).
        chosen_rewards: ``(pairs,)`` ``beta * (pi_c - ref_c)`` (detached).
        rejected_rewards: ``(pairs,)`` ``beta * (pi_r - ref_r)`` (detached).
    """

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        """``(pairs,)`` chosen minus rejected reward."""
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> torch.Tensor:
        """``(pairs,)`` 1.0 where the chosen reward is the larger, else 0.0 (ties count 0)."""
        return (self.chosen_rewards > self.rejected_rewards).float()


def sequence_log_probs(
    token_log_probs: torch.Tensor, mask: torch.Tensor, *, loss: PreferenceLoss
) -> torch.Tensor:
    """Each row's log-probability of its answer: the sum over its answer tokens (``ipo``: the mean).

    Args:
        token_log_probs: ``(rows, seq)`` log-probability of each position's target.
        mask: ``(rows, seq)`` true on answer targets.
        loss: Which loss the values are for (``ipo`` averages).
    """
    maskf = mask.to(token_log_probs.dtype)
    summed = (token_log_probs * maskf).sum(dim=-1)
    match loss:
        case "sigmoid":
            return summed
        case "ipo":
            return summed / maskf.sum(dim=-1).clamp(min=1.0)


def dpo_loss(
    *,
    chosen_log_probs: torch.Tensor,
    rejected_log_probs: torch.Tensor,
    ref_chosen_log_probs: torch.Tensor,
    ref_rejected_log_probs: torch.Tensor,
    config: DPOLossConfig,
) -> DPOLossResult:
    """The preference loss of ``config.loss`` over pairs (TRL's ``DPOTrainer`` formulas).

    Args:
        chosen_log_probs: ``(pairs,)`` the policy's log-probability of each chosen answer (with
            gradient; ``sequence_log_probs`` of the same ``loss``).
        rejected_log_probs: ``(pairs,)`` the same of each rejected answer.
        ref_chosen_log_probs: ``(pairs,)`` the reference model's, for the chosen answers.
        ref_rejected_log_probs: ``(pairs,)`` the reference model's, for the rejected answers.
        config: Loss kind, beta, label smoothing.

    Raises:
        ValueError: If the four tensors are not of one ``(pairs,)`` shape.
    """
    shapes = {
        tuple(t.shape)
        for t in (chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs)
    }
    if len(shapes) != 1 or chosen_log_probs.ndim != 1:
        raise ValueError(f"the four log-probs must be one (pairs,) shape, got shapes {sorted(shapes)}")
    chosen_ratio = chosen_log_probs - ref_chosen_log_probs.detach()
    rejected_ratio = rejected_log_probs - ref_rejected_log_probs.detach()
    margin = chosen_ratio - rejected_ratio
    beta = config.beta
    match config.loss:
        case "sigmoid":
            eps = config.label_smoothing
            losses = -F.logsigmoid(beta * margin) * (1 - eps) - F.logsigmoid(-beta * margin) * eps
        case "ipo":
            losses = (margin - 1 / (2 * beta)) ** 2
    return DPOLossResult(
        loss=losses.mean(),
        chosen_rewards=beta * chosen_ratio.detach(),
        rejected_rewards=beta * rejected_ratio.detach(),
    )
