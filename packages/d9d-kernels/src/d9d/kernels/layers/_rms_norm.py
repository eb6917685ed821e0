"""RMSNorm layer over the fused ``rms_norm`` op."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square normalization over the last dim, with a learned per-channel scale.

    Computed in fp32 and returned in the input dtype (as Llama/Qwen do).

    Args:
        hidden_size: Size of the normalized (last) dim.
        eps: Added to the mean square before the square root.
        zero_centered_weight: Store ``weight - 1`` (the scale is ``1 + weight``, initialized to 0),
            which keeps weight decay from pulling the scale towards zero.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, zero_centered_weight: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_weight = zero_centered_weight
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Sets the scale to one."""
        with torch.no_grad():
            if self.zero_centered_weight:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes ``x`` of shape ``(..., hidden_size)``."""
        return rms_norm(x, self.weight, self.eps, zero_centered_weight=self.zero_centered_weight)

    def add_and_normalize(
        self, residual: torch.Tensor, branch: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + branch, self(residual + branch))``: a branch joins the residual stream, then
        this norm of the stream.

        Without gradients, with no hooks on this module (tensor parallelism's swap in local
        weights around ``forward``) and no ``forward`` of a subclass, the two are one
        ``add_rms_norm`` kernel; otherwise the add and ``forward``.
        """
        hooks: int = len(self._forward_hooks) + len(self._forward_pre_hooks)  # pyright: ignore
        hooked = hooks > 0
        if torch.is_grad_enabled() or hooked or type(self).forward is not RMSNorm.forward:
            total = residual + branch
            return total, self(total)
        return add_rms_norm(
            residual, branch, self.weight, self.eps, zero_centered_weight=self.zero_centered_weight
        )

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_weight={self.zero_centered_weight}"
