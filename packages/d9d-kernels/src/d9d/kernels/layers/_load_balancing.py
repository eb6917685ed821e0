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
    return pooled_load_balancing_loss(load_balancing_statistics(scores, expert_indices, num_experts))


def load_balancing_statistics(
    scores: torch.Tensor,
    expert_indices: torch.Tensor,
    num_experts: int,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the load-balancing loss of one or more routers is computed from, summable over routers.

    Summing the statistics of several layers (or of the stages and micro-steps that hold them)
    and then taking ``pooled_load_balancing_loss`` gives the loss of all their routings pooled
    as one, as Hugging Face's ``load_balancing_loss_func`` computes it over the concatenated
    router logits of every layer. With ``token_mask`` only the tokens it marks count (their
    assignments, scores and number), as ``load_balancing_loss_func`` leaves out the tokens its
    ``attention_mask`` marks as padding.

    Args:
        scores: ``(tokens, num_experts)`` router probabilities.
        expert_indices: ``(tokens, top_k)`` chosen experts.
        num_experts: Number of experts.
        token_mask: ``(tokens,)``, nonzero on the tokens that count; None counts every token.

    Returns:
        ``(2 * num_experts + 1,)`` fp32: the (token, slot) assignments per expert (no gradient),
        the sum of each expert's scores over the tokens (differentiable), and the token count.

    Raises:
        ValueError: If ``token_mask`` does not have one entry per token.
    """
    device = scores.device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    if token_mask is None:
        counts.scatter_add_(
            0,
            expert_indices.reshape(-1),
            torch.ones(expert_indices.numel(), dtype=torch.float32, device=device),
        )
        score_sums = scores.to(torch.float32).sum(dim=0)
        tokens = torch.full((1,), float(scores.shape[0]), dtype=torch.float32, device=device)
        return torch.cat([counts, score_sums, tokens])
    if tuple(token_mask.shape) != (scores.shape[0],):
        raise ValueError(
            f"token_mask has shape {tuple(token_mask.shape)}; the router scored {scores.shape[0]} tokens"
        )
    weights = (token_mask != 0).to(device=device, dtype=torch.float32)
    counts.scatter_add_(
        0,
        expert_indices.reshape(-1),
        weights.unsqueeze(-1).expand(expert_indices.shape).reshape(-1),
    )
    score_sums = (scores.to(torch.float32) * weights.unsqueeze(-1)).sum(dim=0)
    return torch.cat([counts, score_sums, weights.sum().reshape(1)])


def pooled_load_balancing_loss(statistics: torch.Tensor) -> torch.Tensor:
    """``num_experts * sum_e f_e * p_e`` of (summed) ``load_balancing_statistics``.

    ``f_e`` is the assignments to expert ``e`` over the token count and ``p_e`` its mean score,
    both over every routing the statistics sum.

    Args:
        statistics: ``(2 * num_experts + 1,)`` as ``load_balancing_statistics`` returns, or a sum
            of several.

    Returns:
        A scalar fp32 loss (0 when no token was routed).
    """
    if statistics.ndim != 1 or statistics.shape[0] % 2 != 1:
        raise ValueError(
            f"load-balancing statistics must be (2 * num_experts + 1,), got shape {tuple(statistics.shape)}"
        )
    num_experts = statistics.shape[0] // 2
    counts, score_sums, tokens = statistics[:num_experts], statistics[num_experts:-1], statistics[-1]
    tokens = tokens.clamp(min=1.0)
    return num_experts * torch.sum((counts / tokens) * (score_sums / tokens))
