"""Top-k token router of a mixture-of-experts layer, computed in fp32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional

from d9d.kernels.layers._init import init_normal_

RouterScoreFunction = Literal["softmax", "sigmoid"]


@dataclass(kw_only=True)
class RouterOutput:
    """What the router decided for every token.

    Attributes:
        expert_indices: ``(tokens, top_k)`` int64 global expert ids.
        routing_weights: ``(tokens, top_k)`` fp32 weights of the chosen experts.
        scores: ``(tokens, num_experts)`` fp32 scores of every expert (softmax or sigmoid), used by
            the load-balancing loss.
    """

    expert_indices: torch.Tensor
    routing_weights: torch.Tensor
    scores: torch.Tensor


class TopKRouter(nn.Module):
    """Scores experts with a linear gate in fp32 and keeps the ``top_k`` best per token.

    With ``expert_bias`` the selection (not the weights) uses ``scores + expert_bias``: the
    auxiliary-loss-free balancing of DeepSeek-V3, where the bias is nudged towards under-loaded
    experts between steps (``MoELayer.update_expert_bias``). The bias is a persistent buffer, so it
    is checkpointed, and it receives no gradient.

    Args:
        hidden_size: Model width.
        num_experts: Number of experts (global).
        top_k: Experts per token.
        score_function: ``"softmax"`` (Qwen, Mixtral) or ``"sigmoid"`` (DeepSeek-V3).
        renormalize: Divide the chosen weights by their sum.
        expert_bias: Keep a selection bias per expert.
        init_std: Standard deviation of the gate's truncated-normal initialization.
    """

    expert_bias: torch.Tensor | None

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_function: RouterScoreFunction = "softmax",
        renormalize: bool = True,
        expert_bias: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_function: RouterScoreFunction = score_function
        self.renormalize = renormalize
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # a None buffer without the bias: ``enable_expert_bias`` can register it later
        self.register_buffer(
            "expert_bias", torch.zeros(num_experts, dtype=torch.float32) if expert_bias else None
        )
        self.reset_parameters()

    def enable_expert_bias(self) -> None:
        """Adds the selection bias (zeros) to a router built without it; no-op if it has one.

        For a job that turns on auxiliary-loss-free balancing for a model whose architecture does
        not build the bias itself; call before materializing (the buffer follows the gate's
        device, also ``meta``).
        """
        if self.expert_bias is None:
            bias = torch.zeros(self.num_experts, dtype=torch.float32, device=self.weight.device)
            self.register_buffer("expert_bias", bias)

    def reset_parameters(self) -> None:
        """Truncated-normal gate, zero expert bias."""
        init_normal_(self.weight, self.init_std)
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()

    def forward(self, hidden: torch.Tensor) -> RouterOutput:
        """Routes ``(tokens, hidden_size)`` tokens."""
        logits = functional.linear(hidden.to(torch.float32), self.weight.to(torch.float32))
        match self.score_function:
            case "softmax":
                scores = torch.softmax(logits, dim=-1)
            case "sigmoid":
                scores = torch.sigmoid(logits)
        if self.expert_bias is None:
            routing_weights, expert_indices = torch.topk(scores, self.top_k, dim=-1)
        else:
            _, expert_indices = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1)
            routing_weights = scores.gather(-1, expert_indices)
        if self.renormalize:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        return RouterOutput(expert_indices=expert_indices, routing_weights=routing_weights, scores=scores)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, score_function={self.score_function}, "
            f"renormalize={self.renormalize}, expert_bias={self.expert_bias is not None}"
        )
