"""Switch-Transformer load-balancing loss of a router."""

from __future__ import annotations

import torch


def load_balancing_loss(scores: torch.Tensor, expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``num_experts * sum_e f_e * p_e``, as Hugging Face's ``load_balancing_loss_func`` for one layer.

    ``f_e`` is the number of (token, slot) assignments to expert ``e`` divided by the number of
    tokens (so ``sum_e f_e = top_k``) and ``p_e`` the mean score of expert ``e``. A uniform router
    gives ``top_k``; the gradient flows through ``p_e`` only.

    Args:
        scores: ``(tokens, num_experts)`` router probabilities.
        expert_indices: ``(tokens, top_k)`` chosen experts.
        num_experts: Number of experts.

    Returns:
        A scalar fp32 loss.
    """
    tokens = scores.shape[0]
    counts = torch.zeros(num_experts, dtype=torch.float32, device=scores.device)
    counts.scatter_add_(
        0,
        expert_indices.reshape(-1),
        torch.ones(expert_indices.numel(), dtype=torch.float32, device=scores.device),
    )
    assignment_fraction = counts / tokens
    mean_score = scores.to(torch.float32).mean(dim=0)
    return num_experts * torch.sum(assignment_fraction * mean_score)
