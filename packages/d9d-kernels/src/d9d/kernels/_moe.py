"""MoE token permutation: the public ops."""

from __future__ import annotations

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._reference.moe import moe_permute_reference, moe_unpermute_reference


def moe_permute(
    hidden: torch.Tensor,
    expert_indices: torch.Tensor,
    num_experts: int,
    *,
    backend: KernelBackend = KernelBackend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups token copies by expert: one row per (token, k) pair, sorted by expert id (stable).

    Args:
        hidden: Token states (T, H).
        expert_indices: Chosen experts (T, K) int64, each in [0, num_experts).
        num_experts: Number of experts E.
        backend: Which implementation runs (Triton gather on CUDA by default).

    Returns:
        ``(permuted, tokens_per_expert, permutation)``: ``permuted`` (T*K, H) holds, for expert 0
        first, the rows of the tokens routed to it in token order; ``tokens_per_expert`` (E,) int64
        counts them; ``permutation`` (T*K,) int64 gives each permuted row's flat pair index t*K + k.
        Differentiable in ``hidden``.

    Raises:
        ValueError: Shapes or dtypes do not fit.
    """
    if hidden.dim() != 2 or expert_indices.dim() != 2 or expert_indices.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"moe_permute: hidden {tuple(hidden.shape)} must be (T, H) and expert_indices "
            f"{tuple(expert_indices.shape)} must be (T, K)"
        )
    if expert_indices.dtype != torch.int64:
        raise ValueError(f"moe_permute: expert_indices must be int64, got {expert_indices.dtype}")
    if num_experts < 1:
        raise ValueError(f"moe_permute: num_experts={num_experts} must be positive")
    if use_triton(backend, "moe_permute", hidden):
        from d9d.kernels._triton.moe_op import moe_permute_triton

        return moe_permute_triton(hidden, expert_indices, num_experts)
    return moe_permute_reference(hidden, expert_indices, num_experts)


def moe_unpermute(
    permuted_output: torch.Tensor,
    permutation: torch.Tensor,
    routing_weights: torch.Tensor,
    *,
    backend: KernelBackend = KernelBackend.AUTO,
) -> torch.Tensor:
    """Undoes ``moe_permute`` and combines each token's K expert outputs with its routing weights.

    ``out[t] = sum_k routing_weights[t, k] * permuted_output[row of pair t*K + k]``, accumulated in fp32.

    Args:
        permuted_output: Expert outputs (T*K, H) in ``moe_permute`` order.
        permutation: The ``permutation`` that ``moe_permute`` returned (T*K,) int64.
        routing_weights: Routing probabilities (T, K).
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        Combined token states (T, H) in ``permuted_output``'s dtype. Differentiable in
        ``permuted_output`` and ``routing_weights``.

    Raises:
        ValueError: Shapes or dtypes do not fit.
    """
    num_pairs = routing_weights.shape[0] * routing_weights.shape[1] if routing_weights.dim() == 2 else -1
    if (
        permuted_output.dim() != 2
        or tuple(permutation.shape) != (permuted_output.shape[0],)
        or num_pairs != permuted_output.shape[0]
    ):
        raise ValueError(
            f"moe_unpermute: permuted_output {tuple(permuted_output.shape)} must be (T*K, H), permutation "
            f"{tuple(permutation.shape)} (T*K,) and routing_weights {tuple(routing_weights.shape)} (T, K)"
        )
    if permutation.dtype != torch.int64:
        raise ValueError(f"moe_unpermute: permutation must be int64, got {permutation.dtype}")
    if use_triton(backend, "moe_unpermute", permuted_output, routing_weights):
        from d9d.kernels._triton.moe_op import moe_unpermute_triton

        return moe_unpermute_triton(permuted_output, permutation, routing_weights)
    return moe_unpermute_reference(permuted_output, permutation, routing_weights)
