"""SwiGLU experts of a MoE layer, stored as 3-d weights and run through ``grouped_mm``."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from d9d.kernels import grouped_mm
from d9d.kernels.layers._expert_activation import ExpertActivation, PlainSwiGLU, apply_expert_activation
from d9d.kernels.layers._init import init_normal_


class GroupedMatmul(Protocol):
    """``out[rows of g] = x[rows of g] @ weight[g]`` (``grouped_mm`` fits)."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor, /
    ) -> torch.Tensor:
        """Maps ``(M, K)`` rows grouped contiguously and ``(G, K, N)`` weights to ``(M, N)``."""
        ...


class SharedInputGroupedMatmul(Protocol):
    """``(x @ weight_a[g], x @ weight_b[g])`` per group of rows: two products of one input."""

    def __call__(
        self,
        x: torch.Tensor,
        weight_a: torch.Tensor,
        weight_b: torch.Tensor,
        tokens_per_group: torch.Tensor,
        /,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Maps ``(M, K)`` rows and two ``(G, K, N)`` weights to two ``(M, N)`` products."""
        ...


class GroupedSwiGLUExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards evaluated together on tokens grouped by expert.

    Every parameter has the expert as its leading dim, so expert parallelism shards them
    ``Shard(0)`` from outside; the forward reads the local expert count from the weights.

    Parameters (``E`` experts, ``H`` hidden, ``I`` intermediate): ``gate_proj`` and ``up_proj`` of
    shape ``(E, H, I)``, ``down_proj`` of shape ``(E, I, H)`` (input dim first, as ``grouped_mm``
    takes them; Hugging Face's ``nn.Linear`` layout is the transpose).

    The three products run through ``grouped_matmul`` (``grouped_mm`` by default); replacing it
    (an FP8 grouped GEMM, say) changes the arithmetic, never the parameters. Where
    ``shared_input_matmul`` is set, the gate and up products run through it instead, as one call
    (so that work on their common input, a cast say, is done once).

    With ``bias`` each projection adds its expert's bias: ``gate_proj_bias`` and ``up_proj_bias``
    of shape ``(E, I)``, ``down_proj_bias`` of shape ``(E, H)`` (zeros at reset; GPT-OSS).

    Args:
        num_experts: Number of experts.
        hidden_size: Model width.
        intermediate_size: Hidden width of every expert.
        bias: Biases on the three projections.
        activation: The gated activation (``PlainSwiGLU()`` when None; ``ClampedSwiGLU`` for GPT-OSS).
        init_std: Standard deviation of the truncated-normal initialization.
    """

    gate_proj_bias: nn.Parameter | None
    up_proj_bias: nn.Parameter | None
    down_proj_bias: nn.Parameter | None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: ExpertActivation | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.init_std = init_std
        self.grouped_matmul: GroupedMatmul = grouped_mm
        self.shared_input_matmul: SharedInputGroupedMatmul | None = None
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.activation: ExpertActivation = PlainSwiGLU() if activation is None else activation
        widths = {"gate_proj_bias": intermediate_size, "up_proj_bias": intermediate_size}
        for name, width in (*widths.items(), ("down_proj_bias", hidden_size)):
            self.register_parameter(name, nn.Parameter(torch.empty(num_experts, width)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated-normal weights, zero biases."""
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            init_normal_(weight, self.init_std)
        with torch.no_grad():
            for bias in (self.gate_proj_bias, self.up_proj_bias, self.down_proj_bias):
                if bias is not None:
                    bias.zero_()

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Runs each expert on its contiguous group of rows.

        Args:
            tokens: ``(M, hidden_size)`` rows grouped by local expert.
            tokens_per_expert: ``(E_local,)`` int64 group sizes summing to ``M``.

        Returns:
            ``(M, hidden_size)`` expert outputs in the same row order.
        """
        local_experts = self.gate_proj.shape[0]
        if tokens_per_expert.shape != (local_experts,):
            raise ValueError(
                f"tokens_per_expert has shape {tuple(tokens_per_expert.shape)}, expected ({local_experts},) "
                f"for the {local_experts} local experts"
            )
        matmul = self.grouped_matmul
        if self.shared_input_matmul is None:
            gate = matmul(tokens, self.gate_proj, tokens_per_expert)
            up = matmul(tokens, self.up_proj, tokens_per_expert)
        else:
            gate, up = self.shared_input_matmul(tokens, self.gate_proj, self.up_proj, tokens_per_expert)
        experts_of_rows = None if self.down_proj_bias is None else _experts_of_rows(tokens, tokens_per_expert)
        gate = _add_bias(gate, self.gate_proj_bias, experts_of_rows)
        up = _add_bias(up, self.up_proj_bias, experts_of_rows)
        hidden = apply_expert_activation(self.activation, gate, up)
        return _add_bias(
            matmul(hidden, self.down_proj, tokens_per_expert), self.down_proj_bias, experts_of_rows
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, bias={self.down_proj_bias is not None}, "
            f"activation={self.activation}"
        )


def _experts_of_rows(rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``(M, E)`` one-hot of each row's expert, in ``rows``' dtype (``output_size`` given: no host sync)."""
    experts = torch.arange(tokens_per_expert.shape[0], device=rows.device)
    expert_of_row = torch.repeat_interleave(experts, tokens_per_expert, output_size=rows.shape[0])
    return (expert_of_row.unsqueeze(1) == experts.unsqueeze(0)).to(rows.dtype)


def _add_bias(
    rows: torch.Tensor, bias: torch.Tensor | None, experts_of_rows: torch.Tensor | None
) -> torch.Tensor:
    """``rows`` plus each row's expert's bias.

    A matmul with the one-hot ``experts_of_rows`` rather than a gather: the bias's gradient is then
    one dense ``(E, M) @ (M, width)`` matmul, where a gather's backward adds every row into its
    expert's bias with atomics (``index_add``, about 1.8 ms per bias at GPT-OSS-20B's widths on an
    H200: a tenth of the step).
    """
    if bias is None or experts_of_rows is None:
        return rows
    return rows + experts_of_rows @ bias.to(rows.dtype)
