"""Top-k token router of a mixture-of-experts layer, computed in fp32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional

from d9d.kernels.layers._init import init_normal_

RouterScoreFunction = Literal["softmax", "sigmoid"]


@dataclass(kw_only=True, frozen=True)
class TopKSelection:
    """Every expert competes for a token; the ``top_k`` best (biased) scores win."""

    kind: Literal["top_k"] = "top_k"


@dataclass(kw_only=True, frozen=True)
class GroupLimitedSelection:
    """Group-limited top-k (DeepSeek-V3's ``n_group`` / ``topk_group``).

    The experts form ``num_groups`` equal consecutive groups; a group's score is the sum of its
    two best (biased) expert scores; per token only the experts of the ``top_groups`` best groups
    compete for the ``top_k`` places.

    Attributes:
        num_groups: Groups the experts are split into (divides the expert count).
        top_groups: Groups kept per token.
    """

    num_groups: int
    top_groups: int
    kind: Literal["group_limited"] = "group_limited"


RouterSelection = TopKSelection | GroupLimitedSelection
"""How a router picks a token's experts from their scores, told apart by ``kind``."""


def _check_selection(selection: RouterSelection, num_experts: int, top_k: int) -> None:
    match selection:
        case TopKSelection():
            return
        case GroupLimitedSelection(num_groups=groups, top_groups=kept):
            if groups <= 0 or num_experts % groups != 0 or num_experts // groups < 2:
                raise ValueError(
                    f"GroupLimitedSelection num_groups={groups} must divide num_experts={num_experts} "
                    "into groups of at least 2 experts (a group scores by its two best)"
                )
            if not 0 < kept <= groups or top_k > kept * (num_experts // groups):
                raise ValueError(
                    f"GroupLimitedSelection top_groups={kept} must be in [1, num_groups={groups}] and "
                    f"hold at least top_k={top_k} experts"
                )


def _limit_to_groups(choice: torch.Tensor, selection: GroupLimitedSelection) -> torch.Tensor:
    """``choice`` with the experts outside each token's ``top_groups`` best groups at ``-inf``."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, selection.num_groups, experts // selection.num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.topk(group_scores, selection.top_groups, dim=-1, sorted=False).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~allowed[..., None], float("-inf")).view(tokens, experts)


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
        bias: A learned bias on the gate's logits (GPT-OSS), the ``bias`` parameter; it moves
            scores and weights alike. GPT-OSS's "top-k of the logits, softmax over those k" is
            ``score_function="softmax"`` with ``renormalize=True`` (the same weights).
        score_function: ``"softmax"`` (Qwen, Mixtral) or ``"sigmoid"`` (DeepSeek-V3).
        renormalize: Divide the chosen weights by their sum.
        expert_bias: Keep a selection bias per expert.
        selection: How the experts are picked (``TopKSelection()`` when None;
            ``GroupLimitedSelection`` for DeepSeek-V3's group-limited routing).
        routed_scaling_factor: Multiplier of the chosen weights, after any renormalization
            (DeepSeek-V3's ``routed_scaling_factor``).
        init_std: Standard deviation of the gate's truncated-normal initialization.
    """

    expert_bias: torch.Tensor | None

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        bias: bool = False,
        score_function: RouterScoreFunction = "softmax",
        renormalize: bool = True,
        expert_bias: bool = False,
        selection: RouterSelection | None = None,
        routed_scaling_factor: float = 1.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.selection: RouterSelection = TopKSelection() if selection is None else selection
        _check_selection(self.selection, num_experts, top_k)
        self.routed_scaling_factor = routed_scaling_factor
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_function: RouterScoreFunction = score_function
        self.renormalize = renormalize
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
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
        """Truncated-normal gate and gate bias, zero expert bias."""
        init_normal_(self.weight, self.init_std)
        if self.bias is not None:
            init_normal_(self.bias, self.init_std)
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()

    def forward(self, hidden: torch.Tensor) -> RouterOutput:
        """Routes ``(tokens, hidden_size)`` tokens."""
        gate_bias = None if self.bias is None else self.bias.to(torch.float32)
        logits = functional.linear(hidden.to(torch.float32), self.weight.to(torch.float32), gate_bias)
        match self.score_function:
            case "softmax":
                scores = torch.softmax(logits, dim=-1)
            case "sigmoid":
                scores = torch.sigmoid(logits)
        choice = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias
        match self.selection:
            case TopKSelection():
                pass
            case GroupLimitedSelection():
                choice = _limit_to_groups(choice, self.selection)
        _, expert_indices = torch.topk(choice, self.top_k, dim=-1)
        routing_weights = scores.gather(-1, expert_indices)
        if self.renormalize:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            routing_weights = routing_weights * self.routed_scaling_factor
        return RouterOutput(expert_indices=expert_indices, routing_weights=routing_weights, scores=scores)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, score_function={self.score_function}, "
            f"renormalize={self.renormalize}, expert_bias={self.expert_bias is not None}, "
            f"selection={self.selection}, routed_scaling_factor={self.routed_scaling_factor}"
        )
