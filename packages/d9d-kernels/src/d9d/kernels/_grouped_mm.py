"""Grouped matmul for MoE experts: the public op."""

from __future__ import annotations

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._reference.moe import grouped_mm_reference


def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_group: torch.Tensor,
    *,
    backend: KernelBackend = KernelBackend.AUTO,
) -> torch.Tensor:
    """One matmul per group of contiguous rows: ``out[rows of g] = x[rows of g] @ weight[g]``.

    On CUDA, bf16 inputs go to PyTorch's grouped GEMM (``torch.nn.functional.grouped_mm``, CUTLASS)
    when it is present and the sizes meet its alignment needs; otherwise a Triton grouped GEMM runs.
    The reference loops over groups (one host sync for the sizes). Differentiable in ``x`` and
    ``weight``.

    Args:
        x: Rows (M, K), grouped contiguously.
        weight: Per-group matrices (G, K, N).
        tokens_per_group: Rows per group (G,) int64, summing to M.
        backend: Which implementation runs (grouped GEMM on CUDA by default).

    Returns:
        (M, N) in ``x``'s dtype.

    Raises:
        ValueError: Shapes or dtypes do not fit.
    """
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"grouped_mm: x {tuple(x.shape)} must be (M, K) and weight {tuple(weight.shape)} (G, K, N)"
        )
    if tuple(tokens_per_group.shape) != (weight.shape[0],) or tokens_per_group.dtype != torch.int64:
        raise ValueError(
            f"grouped_mm: tokens_per_group must be int64 of shape ({weight.shape[0]},), got "
            f"{tokens_per_group.dtype} {tuple(tokens_per_group.shape)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"grouped_mm: x dtype {x.dtype} != weight dtype {weight.dtype}")
    if use_triton(backend, "grouped_mm", x, weight):
        from d9d.kernels._triton.grouped_mm_op import grouped_mm_triton

        return grouped_mm_triton(x, weight, tokens_per_group, backend == KernelBackend.TRITON)
    return grouped_mm_reference(x, weight, tokens_per_group)
