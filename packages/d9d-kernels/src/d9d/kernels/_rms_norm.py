"""RMSNorm: the public op."""

from __future__ import annotations

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._reference.rms_norm import rms_norm_reference


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered_weight: bool = False,
    backend: KernelBackend = KernelBackend.AUTO,
) -> torch.Tensor:
    """Root-mean-square normalization over the last dim, scaled by a learned weight.

    ``y = x / sqrt(mean(x**2) + eps) * w`` with ``w = weight``, or ``w = 1 + weight`` when
    ``zero_centered_weight`` is set (weights initialized at zero, as in Gemma / Qwen3-Next). The
    statistics and the product are computed in fp32; the result has ``x``'s dtype. Differentiable in
    ``x`` and ``weight``.

    Args:
        x: Input of shape (..., hidden).
        weight: Scale of shape (hidden,).
        eps: Added to the mean square before the square root.
        zero_centered_weight: Use ``1 + weight`` as the scale.
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        The normalized tensor, shaped and typed like ``x``.

    Raises:
        ValueError: ``weight`` is not 1-D of size ``x.shape[-1]``.
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight shape {tuple(weight.shape)} does not match the last dim of x "
            f"{tuple(x.shape)}; expected ({x.shape[-1]},)"
        )
    if use_triton(backend, "rms_norm", x, weight, fusible=True):
        from d9d.kernels._triton.rms_norm_op import rms_norm_triton

        return rms_norm_triton(x, weight, eps, zero_centered_weight)
    return rms_norm_reference(x, weight, eps, zero_centered_weight)


def add_rms_norm(
    residual: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered_weight: bool = False,
    backend: KernelBackend = KernelBackend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``total = residual + branch`` and ``rms_norm(total, weight, eps)``: a branch joining the
    residual stream, and the norm of the stream that follows.

    Without gradients the Triton path is one kernel (a decode step's residual add was a launch of
    its own); ``total`` is rounded to the stream's dtype and normalized from there, as the unfused
    ops compute it. With gradients, under ``torch.compile`` (Inductor fuses the two itself), for
    tensor subclasses and on the reference backend it is the add and ``rms_norm``.

    Args:
        residual: The residual stream, ``(..., hidden)``.
        branch: What joins it, of the same shape and dtype.
        weight: Scale of shape (hidden,).
        eps: Added to the mean square before the square root.
        zero_centered_weight: Use ``1 + weight`` as the scale.
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        ``(total, normalized)``, both shaped and typed like ``residual``.

    Raises:
        ValueError: ``branch`` differs from ``residual`` in shape or dtype, or ``weight`` does not
            match the last dim.
    """
    _check_branch("add_rms_norm", residual, branch)
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (residual, branch, weight))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (residual, branch, weight))
    if (
        plain
        and not needs_grad
        and weight.dim() == 1
        and weight.shape[0] == residual.shape[-1]
        and use_triton(backend, "add_rms_norm", residual, branch, weight, fusible=True)
    ):
        from d9d.kernels._triton.rms_norm_kernels import add_rms_norm_forward

        return add_rms_norm_forward(residual, branch, weight, eps, zero_centered_weight)
    total = residual + branch
    return total, rms_norm(total, weight, eps, zero_centered_weight=zero_centered_weight, backend=backend)


def rms_norm_add(
    residual: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered_weight: bool = False,
    scale: float = 1.0,
    next_weight: torch.Tensor | None = None,
    next_eps: float = 1e-6,
    next_zero_centered_weight: bool = False,
    backend: KernelBackend = KernelBackend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A normalized branch joining the residual stream, and optionally the norm of the stream after.

    ``total = residual + scale * rms_norm(branch, weight)``, and with ``next_weight``
    ``rms_norm(total, next_weight)``: the junction of a post-norm layer (OLMo 2's norm after each
    branch; Gemma 3's post-attention norm, the add, then the pre-feed-forward norm). The Triton
    path reads each row once per direction and sums the weights' gradients on the way, also under
    ``torch.compile`` (a custom op), where Inductor's fused code for rows wider than 1024 loops
    over each row once per reduction. Each intermediate is rounded to the input dtype where the
    unfused ops store it.

    Args:
        residual: The residual stream, ``(..., hidden)``.
        branch: What joins it after its norm, of the same shape and dtype.
        weight: The branch norm's scale, ``(hidden,)``.
        eps: The branch norm's epsilon.
        zero_centered_weight: The branch norm scales by ``1 + weight``.
        scale: Multiplies the normalized branch (a residual multiplier).
        next_weight: The following norm's scale, or None for the sum alone.
        next_eps: The following norm's epsilon.
        next_zero_centered_weight: The following norm scales by ``1 + next_weight``.
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        ``(total, normalized)``; ``normalized`` is None without ``next_weight``.

    Raises:
        ValueError: ``branch`` differs from ``residual`` in shape or dtype, or a weight does not
            match the last dim.
    """
    _check_branch("rms_norm_add", residual, branch)
    for name, w in (("weight", weight), ("next_weight", next_weight)):
        if w is not None and (w.dim() != 1 or w.shape[0] != residual.shape[-1]):
            raise ValueError(
                f"rms_norm_add: {name} shape {tuple(w.shape)} does not match the last dim of the residual "
                f"{tuple(residual.shape)}; expected ({residual.shape[-1]},)"
            )
    weights = (weight,) if next_weight is None else (weight, next_weight)
    if use_triton(backend, "rms_norm_add", residual, branch, *weights):
        from d9d.kernels._triton.norm_add_op import rms_norm_add_triton

        return rms_norm_add_triton(
            residual,
            branch,
            weight,
            next_weight,
            eps,
            next_eps,
            scale,
            zero_centered_weight,
            next_zero_centered_weight,
        )
    normed = rms_norm_reference(branch, weight, eps, zero_centered_weight)
    total = residual + (normed if scale == 1.0 else normed * scale)
    if next_weight is None:
        return total, None
    return total, rms_norm_reference(total, next_weight, next_eps, next_zero_centered_weight)


def _check_branch(op: str, residual: torch.Tensor, branch: torch.Tensor) -> None:
    """Raises a ``ValueError`` naming ``op`` when ``branch`` differs from ``residual`` in shape or dtype."""
    if branch.shape != residual.shape or branch.dtype != residual.dtype:
        raise ValueError(
            f"{op}: branch {tuple(branch.shape)} {branch.dtype} must match the residual "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
