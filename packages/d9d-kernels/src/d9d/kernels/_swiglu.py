"""SwiGLU: the public op."""

from __future__ import annotations

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._reference.swiglu import swiglu_reference


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, *, backend: KernelBackend = KernelBackend.AUTO
) -> torch.Tensor:
    """``silu(gate) * up``, the gated activation of SwiGLU feed-forward blocks.

    Computed in fp32 and returned in ``gate``'s dtype; differentiable in both inputs. The Triton path
    recomputes ``silu`` in the backward instead of saving it, so only the two inputs are kept.

    Args:
        gate: Gate projection, any shape.
        up: Up projection, same shape and dtype as ``gate``.
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        The activation, shaped and typed like ``gate``.

    Raises:
        ValueError: ``gate`` and ``up`` differ in shape or dtype.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
            "must have the same shape and dtype"
        )
    if use_triton(backend, "swiglu", gate, up, fusible=True):
        from d9d.kernels._triton.swiglu_op import swiglu_triton

        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)
