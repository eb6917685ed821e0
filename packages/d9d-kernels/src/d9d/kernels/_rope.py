"""Rotary position embedding: the public op."""

from __future__ import annotations

from typing import Literal

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._reference.rope import apply_rope_reference

RopeLayout = Literal["half", "interleaved"]


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    layout: RopeLayout = "half",
    backend: KernelBackend = KernelBackend.AUTO,
) -> torch.Tensor:
    """Rotates query or key vectors by position-dependent angles: ``x * cos + rotate(x) * sin``.

    Uses the Hugging Face convention for ``cos`` / ``sin``: per position, the frequencies ``f`` of
    the head_dim / 2 rotation planes are laid out as ``cat(f, f)`` for the "half" layout (element ``i``
    rotates with ``i + head_dim / 2``: Llama, Qwen) and as ``repeat_interleave(f, 2)`` for the
    "interleaved" layout (element ``2i`` rotates with ``2i + 1``: GPT-J). Computed in fp32, returned in
    ``x``'s dtype. Differentiable in ``x``; the Triton path gives no gradient for ``cos`` / ``sin``, so
    when they require grad the reference runs instead (except with ``backend=TRITON``, which raises).

    Args:
        x: Queries or keys of shape (batch, seq, heads, head_dim), head_dim even.
        cos: Cosines of shape (batch, seq, head_dim), shared by every head.
        sin: Sines of the same shape.
        layout: Which elements form a rotation pair.
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        The rotated tensor, shaped and typed like ``x``.

    Raises:
        ValueError: Shapes do not fit, head_dim is odd, or ``layout`` is unknown.
        RuntimeError: ``backend`` is TRITON and ``cos`` or ``sin`` requires grad.
    """
    check_rotated("apply_rope", "x", x, cos, sin)
    if layout not in ("half", "interleaved"):
        raise ValueError(f"apply_rope: layout={layout!r} is not 'half' or 'interleaved'")
    angles_need_grad = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    if angles_need_grad and backend == KernelBackend.TRITON:
        raise RuntimeError("apply_rope: backend=triton does not differentiate cos / sin, which require grad")
    if not angles_need_grad and use_triton(backend, "apply_rope", x, cos, sin, fusible=True):
        from d9d.kernels._triton.rope_op import apply_rope_triton

        return apply_rope_triton(x, cos, sin, layout == "interleaved")
    return apply_rope_reference(x, cos, sin, layout)


def check_rotated(op: str, name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raises ValueError naming ``op`` unless ``x`` is ``(batch, seq, heads, head_dim)`` with an even
    ``head_dim`` and ``cos`` / ``sin`` are ``(batch, seq, head_dim)``."""
    if x.dim() != 4:
        raise ValueError(f"{op}: {name} must be (batch, seq, heads, head_dim), got {tuple(x.shape)}")
    batch, seq, _, head_dim = x.shape
    if head_dim % 2 != 0:
        raise ValueError(f"{op}: head_dim={head_dim} must be even")
    for table_name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (batch, seq, head_dim):
            raise ValueError(
                f"{op}: {table_name} must be (batch, seq, head_dim) = {(batch, seq, head_dim)}, "
                f"got {tuple(table.shape)}"
            )
