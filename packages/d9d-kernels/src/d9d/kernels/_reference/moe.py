"""MoE token permutation and grouped matmul in plain PyTorch."""

from __future__ import annotations

import torch

from d9d.kernels._reference.precision import upcast


def moe_permute_reference(
    hidden: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies each (token, k) pair's row, sorted by expert id (stable); see ``d9d.kernels.moe_permute``."""
    top_k = expert_indices.shape[1]
    flat = expert_indices.reshape(-1)
    permutation = torch.argsort(flat, stable=True)
    permuted = hidden[torch.div(permutation, top_k, rounding_mode="floor")]
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)
    return permuted, tokens_per_expert, permutation


def moe_unpermute_reference(
    permuted_output: torch.Tensor, permutation: torch.Tensor, routing_weights: torch.Tensor
) -> torch.Tensor:
    """Routing-weighted sum over k of each token's rows, in fp32; see ``d9d.kernels.moe_unpermute``."""
    num_tokens, top_k = routing_weights.shape
    rows = upcast(permuted_output)
    flat = torch.zeros_like(rows).index_copy(0, permutation, rows)
    weighted = flat.view(num_tokens, top_k, -1) * upcast(routing_weights).unsqueeze(-1)
    return weighted.sum(dim=1).to(permuted_output.dtype)


def grouped_mm_reference(
    x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor
) -> torch.Tensor:
    """One matmul per group of contiguous rows: ``out[rows of g] = x[rows of g] @ weight[g]``."""
    sizes = [int(n) for n in tokens_per_group.cpu()]
    pieces = [chunk @ weight[g] for g, chunk in enumerate(torch.split(x, sizes, dim=0))]
    if not pieces:
        return x.new_zeros((x.shape[0], weight.shape[2]))
    return torch.cat(pieces, dim=0)
