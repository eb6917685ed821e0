"""Gated feed-forward block: down(act(gate(x)) * up(x)), SiLU (SwiGLU) or tanh-approximated GELU."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from d9d.kernels import shared_input_linear, swiglu, swiglu_projection
from d9d.kernels.layers._init import init_linear_
from d9d.kernels.layers._recomputed_activation import recompute_when_saved


class SwiGLU(nn.Module):
    """Gated feed-forward with SiLU gate, as in Llama, Qwen and most current LLMs.

    The three projections are plain ``nn.Linear`` modules named ``gate_proj``, ``up_proj`` and
    ``down_proj`` so tensor parallelism can shard gate/up by columns and down by rows from outside.
    The gated activation is not kept for backward: ``down_proj``'s backward recomputes it from the
    gate and up projections (kept anyway by the activation's own backward), which saves
    ``intermediate_size`` values per token for one cheap elementwise kernel.

    Args:
        hidden_size: Model width.
        intermediate_size: Width of the gated hidden layer.
        bias: Whether the projections have biases.
        init_std: Standard deviation of the truncated-normal weight initialization.
        activation: The gate's activation: ``"silu"`` (SwiGLU, the fused kernel) or
            ``"gelu_tanh"`` (GeGLU with the tanh approximation, transformers'
            ``gelu_pytorch_tanh``).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        init_std: float = 0.02,
        activation: Literal["silu", "gelu_tanh"] = "silu",
    ) -> None:
        super().__init__()
        self.init_std = init_std
        self.activation: Literal["silu", "gelu_tanh"] = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated-normal weights, zero biases."""
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            init_linear_(linear, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``(..., hidden_size)`` to ``(..., hidden_size)``.

        Without gradients a SwiGLU's input side is one ``swiglu_projection`` call, which a decode
        step's ``FewRowsLinearMode`` computes in one launch.
        """
        if self.activation == "silu" and not torch.is_grad_enabled():
            return self.down_proj(swiglu_projection(x, self.gate_proj, self.up_proj))
        gate, up = shared_input_linear(x, (self.gate_proj, self.up_proj))
        activation = self._gated(gate, up)
        with recompute_when_saved(activation, lambda: self._gated(gate.detach(), up.detach())):
            return self.down_proj(activation)

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        match self.activation:
            case "silu":
                return swiglu(gate, up)
            case "gelu_tanh":
                return F.gelu(gate, approximate="tanh") * up
