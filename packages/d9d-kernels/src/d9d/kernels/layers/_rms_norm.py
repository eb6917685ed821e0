"""RMSNorm layer over the fused ``rms_norm`` op."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels import add_rms_norm, rms_norm, rms_norm_add


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
        if torch.is_grad_enabled() or not _plain(self):
            total = residual + branch
            return total, self(total)
        return add_rms_norm(
            residual, branch, self.weight, self.eps, zero_centered_weight=self.zero_centered_weight
        )

    def normalize_and_add(
        self, residual: torch.Tensor, branch: torch.Tensor, *, scale: float = 1.0, then: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(total, then(total))`` with ``total = residual + scale * self(branch)``: a post-norm
        branch joins the residual stream, and the next norm (None: ``total`` again) reads it.

        Plain modules run one ``rms_norm_add`` (one Triton kernel each way on CUDA, compiled or
        not); with hooks on either norm (tensor parallelism swaps in local weights around
        ``forward``), a tensor subclass (DTensor) or a subclass's own ``forward`` it is
        ``self``, the add and ``then`` as separate calls.
        """
        norms = (self,) if then is None else (self, then)
        tensors = (residual, branch, *(norm.weight for norm in norms))
        if not all(_plain(norm) for norm in norms) or any(
            type(t) not in (torch.Tensor, nn.Parameter) for t in tensors
        ):
            normed = self(branch)
            total = residual + (normed if scale == 1.0 else normed * scale)
            return total, total if then is None else then(total)
        total, normalized = rms_norm_add(
            residual,
            branch,
            self.weight,
            self.eps,
            zero_centered_weight=self.zero_centered_weight,
            scale=scale,
            next_weight=None if then is None else then.weight,
            next_eps=self.eps if then is None else then.eps,
            next_zero_centered_weight=False if then is None else then.zero_centered_weight,
        )
        return total, total if normalized is None else normalized

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_weight={self.zero_centered_weight}"


def _plain(norm: RMSNorm) -> bool:
    """No hooks on ``norm`` and no ``forward`` of a subclass: its weight may be read directly."""
    hooks: int = len(norm._forward_hooks) + len(norm._forward_pre_hooks)  # pyright: ignore
    return hooks == 0 and type(norm).forward is RMSNorm.forward
