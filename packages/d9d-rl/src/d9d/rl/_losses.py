"""Policy-gradient losses: GRPO (clipped ratio, optional k3 KL) and REINFORCE with a baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

Averaging = Literal["token", "sequence"]
"""How per-token losses become one number.

``token``: the mean over every completion token of the batch (DAPO / TRL's ``bnpo``: long answers
weigh by their length). ``sequence``: the mean over sequences of each sequence's token mean (the
DeepSeekMath paper's GRPO objective).
"""


class GRPOLossConfig(BaseModel):
    """The GRPO objective's constants.

    Attributes:
        epsilon_low: The ratio is clipped below at ``1 - epsilon_low``.
        epsilon_high: The ratio is clipped above at ``1 + epsilon_high`` (DAPO's clip-higher when
            larger than ``epsilon_low``).
        kl_coefficient: Weight of the k3 estimate of KL(policy || reference); 0 needs no
            reference model.
        averaging: See ``Averaging``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    epsilon_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    epsilon_high: float = Field(default=0.2, ge=0.0)
    kl_coefficient: float = Field(default=0.0, ge=0.0)
    averaging: Averaging = "token"


@dataclass(kw_only=True, frozen=True)
class PolicyLossResult:
    """A loss over one (micro)batch and the weight d9d-loop averages it with.

    Attributes:
        loss: The scalar to minimize: a mean over tokens or sequences (see ``Averaging``).
        weight: How many tokens (``token``) or sequences (``sequence``) the mean is over, so that
            ``sum(weight * loss) / sum(weight)`` over microbatches and ranks is the batch's mean.
        clip_fraction: Share of completion tokens whose ratio was clipped (detached; GRPO only).
        kl: Mean k3 KL estimate over completion tokens (detached; 0 without ``ref_log_probs``).
    """

    loss: torch.Tensor
    weight: float
    clip_fraction: float = 0.0
    kl: float = 0.0


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages: each reward minus its group's mean (over its std when ``scale``).

    Args:
        rewards: ``(groups * group_size,)``, the completions of one prompt adjacent.
        group_size: Completions per prompt.
        scale: Divide by the group's (unbiased) standard deviation plus ``eps``, as GRPO does;
            False gives REINFORCE's group-mean baseline.
        eps: Keeps a group of equal rewards at advantage 0 instead of 0 / 0.

    Returns:
        ``(groups * group_size,)`` advantages.
    """
    if rewards.ndim != 1 or group_size <= 0 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} are not whole groups of group_size={group_size}"
        )
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def _average(per_token: torch.Tensor, mask: torch.Tensor, averaging: Averaging) -> tuple[torch.Tensor, float]:
    maskf = mask.to(per_token.dtype)
    match averaging:
        case "token":
            count = float(maskf.sum().item())
            return (per_token * maskf).sum() / max(count, 1.0), count
        case "sequence":
            per_sequence = (per_token * maskf).sum(dim=1) / maskf.sum(dim=1).clamp(min=1.0)
            rows = per_token.shape[0]
            return per_sequence.sum() / max(rows, 1), float(rows)


def _check_shapes(log_probs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> None:
    if log_probs.ndim != 2 or mask.shape != log_probs.shape or advantages.shape != log_probs.shape[:1]:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and mask {tuple(mask.shape)} must be (batch, seq) and "
            f"advantages {tuple(advantages.shape)} (batch,)"
        )


def grpo_loss(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig,
    ref_log_probs: torch.Tensor | None = None,
) -> PolicyLossResult:
    """The GRPO loss (DeepSeekMath, eq. 3; TRL's ``GRPOTrainer``).

    Per token: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta k3`` with
    ``r = exp(log_probs - old_log_probs)`` and ``k3 = exp(ref - lp) - (ref - lp) - 1``.

    Args:
        log_probs: ``(batch, seq)`` log-probabilities of the sampled tokens under the policy
            being trained (with gradient).
        old_log_probs: ``(batch, seq)`` the same under the policy that sampled them.
        advantages: ``(batch,)`` one advantage per sequence.
        mask: ``(batch, seq)`` true on completion tokens.
        config: Clipping, KL weight and averaging.
        ref_log_probs: ``(batch, seq)`` under the reference model; needed when
            ``config.kl_coefficient > 0``. When given, ``kl`` reports the mean k3 estimate
            (whatever the coefficient).
    """
    _check_shapes(log_probs, mask, advantages)
    ratio = torch.exp(log_probs - old_log_probs.detach())
    adv = advantages.detach().to(log_probs.dtype)[:, None]
    clipped = ratio.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl_mean = 0.0
    maskf = mask.to(log_probs.dtype)
    tokens = maskf.sum().clamp(min=1.0)
    if config.kl_coefficient > 0 and ref_log_probs is None:
        raise ValueError(f"kl_coefficient={config.kl_coefficient} needs ref_log_probs")
    if ref_log_probs is not None:
        delta = ref_log_probs.detach() - log_probs
        k3 = torch.exp(delta) - delta - 1.0
        if config.kl_coefficient > 0:
            per_token = per_token + config.kl_coefficient * k3
        kl_mean = float(((k3.detach() * maskf).sum() / tokens).item())
    loss, weight = _average(per_token, mask, config.averaging)
    was_clipped = ((ratio.detach() - clipped.detach()).abs() > 0).to(maskf.dtype)
    clip_fraction = float(((was_clipped * maskf).sum() / tokens).item())
    return PolicyLossResult(loss=loss, weight=weight, clip_fraction=clip_fraction, kl=kl_mean)


def reinforce_loss(
    *,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    averaging: Averaging = "token",
) -> PolicyLossResult:
    """REINFORCE with a baseline: ``-A * log_probs`` per token, ``A = reward - baseline``.

    Use ``group_advantages(rewards, group_size, scale=False)`` for the group-mean baseline.

    Args:
        log_probs: ``(batch, seq)`` log-probabilities of the sampled tokens (with gradient).
        advantages: ``(batch,)`` rewards minus the baseline.
        mask: ``(batch, seq)`` true on completion tokens.
        averaging: See ``Averaging``.
    """
    _check_shapes(log_probs, mask, advantages)
    per_token = -advantages.detach().to(log_probs.dtype)[:, None] * log_probs
    loss, weight = _average(per_token, mask, averaging)
    return PolicyLossResult(loss=loss, weight=weight)
