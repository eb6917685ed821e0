"""Fused linear + cross-entropy: the public op."""

from __future__ import annotations

from typing import Literal

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._reference.linear_cross_entropy import linear_cross_entropy_reference

CrossEntropyReduction = Literal["mean", "sum", "none"]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: CrossEntropyReduction = "mean",
    uniform_upstream_gradient: bool = False,
    chunk_size: int | None = None,
    backend: KernelBackend = KernelBackend.AUTO,
) -> torch.Tensor:
    """Cross-entropy of the language-model head ``hidden @ weight.T`` without materializing its logits.

    The Triton path walks the tokens in chunks: each chunk's logits are computed by one matmul, turned
    in place into the loss and the gradient of the logits by a Triton kernel, and multiplied back into
    the gradients of ``hidden`` and ``weight``, so at most one chunk of logits lives at a time. With
    "mean" / "sum" the gradients are computed during the forward (the upstream gradient is a scalar
    that scales them in the backward, in place: do not backward through one result twice); with
    "none" the backward recomputes the chunk logits, unless ``uniform_upstream_gradient`` says that
    the caller reduces the per-token losses with one weight (a sum or a mean over targets, in any
    later expression): then the forward computes the gradients as for "sum" and the backward scales
    them, which saves a third of the head's matmuls. Logits have the inputs' dtype (as in eager
    ``hidden @ weight.T``); the softmax is computed in fp32.

    Args:
        hidden: Final hidden states (N, H).
        weight: Output embedding (V, H), same dtype as ``hidden``.
        labels: Target ids (N,) int64; ``ignore_index`` marks tokens without a loss.
        ignore_index: Label value that is excluded from the loss.
        reduction: "none" for per-token losses (N,) fp32 with 0 at ignored tokens, "sum", or "mean"
            over non-ignored tokens (0 when all are ignored).
        uniform_upstream_gradient: With "none": the gradient that reaches the per-token losses
            is the same at every target token (each hidden row's gradient stays exact for any
            upstream gradient; the weight's is scaled by the mean over target tokens, exact only
            under this promise). Leave it False when tokens are weighted differently (e.g.
            per-token advantages). Ignored by the plain PyTorch path, which is always exact.
        chunk_size: Tokens per chunk on the Triton path; by default as many as keep one chunk's
            logits near 256 MiB, or a quarter of the tokens when that is more (up to 2 GiB of
            logits), in multiples of 256 tokens.
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        The loss: fp32, a scalar or (N,).

    Raises:
        ValueError: Shapes, dtypes or ``reduction`` do not fit.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} must be (N, H) and weight "
            f"{tuple(weight.shape)} must be (V, H) with the same H"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden dtype {hidden.dtype} != weight dtype {weight.dtype}")
    if tuple(labels.shape) != (hidden.shape[0],) or labels.dtype != torch.int64:
        raise ValueError(
            f"linear_cross_entropy: labels must be int64 of shape ({hidden.shape[0]},), got "
            f"{labels.dtype} {tuple(labels.shape)}"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size} must be positive")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r} is not 'mean', 'sum' or 'none'")
    if use_triton(backend, "linear_cross_entropy", hidden, weight):
        from d9d.kernels._triton.linear_cross_entropy_op import linear_cross_entropy_triton

        mode = "none_uniform" if reduction == "none" and uniform_upstream_gradient else reduction
        return linear_cross_entropy_triton(hidden, weight, labels, ignore_index, mode, chunk_size or 0)
    return linear_cross_entropy_reference(hidden, weight, labels, ignore_index, reduction)
