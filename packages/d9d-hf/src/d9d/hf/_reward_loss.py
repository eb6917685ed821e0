"""The Bradley-Terry pairwise loss of a reward model (TRL's ``RewardTrainer`` objective)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, *, center_rewards_coefficient: float | None = None
) -> torch.Tensor:
    """``mean(-logsigmoid(chosen - rejected))``, plus ``c * mean((chosen + rejected) ** 2)``.

    The second term (TRL's ``center_rewards_coefficient``, Eisenstein et al. 2023) pulls the
    rewards towards zero mean; None or 0 leaves it out.

    Args:
        chosen: ``(pairs,)`` rewards of the preferred sides.
        rejected: ``(pairs,)`` rewards of the dispreferred sides.
        center_rewards_coefficient: The centering term's factor.

    Raises:
        ValueError: If the shapes differ or are not one-dimensional.
    """
    if chosen.ndim != 1 or chosen.shape != rejected.shape:
        raise ValueError(
            f"chosen and rejected rewards must be (pairs,) each, got {tuple(chosen.shape)} and "
            f"{tuple(rejected.shape)}"
        )
    chosen, rejected = chosen.float(), rejected.float()
    loss = -F.logsigmoid(chosen - rejected).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss
