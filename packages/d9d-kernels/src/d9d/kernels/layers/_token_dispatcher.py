"""The token dispatcher slot of a MoE layer and its local (single-device) implementation."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from d9d.kernels import moe_permute, moe_unpermute


@runtime_checkable
class TokenDispatcher(Protocol):
    """Moves routed tokens to the experts and their outputs back.

    ``MoELayer.dispatcher`` holds one. The local default keeps tokens on this device; d9d-parallel's
    expert parallelism installs an all-to-all dispatcher that fits structurally (its own Protocol
    restates the signature and refers here for the meaning). A dispatcher keeps per-call state
    between ``dispatch`` and ``combine``.
    """

    def dispatch(
        self, hidden: torch.Tensor, expert_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Groups token copies by the local expert that processes them.

        Args:
            hidden: ``(tokens, hidden_size)``.
            expert_indices: ``(tokens, top_k)`` global expert ids.
            routing_weights: ``(tokens, top_k)``.

        Returns:
            ``(grouped_tokens (M, hidden_size), tokens_per_local_expert (E_local,) int64)``, the
            tokens contiguous per local expert in expert order.
        """
        ...

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Returns ``(tokens, hidden_size)``: routing-weighted sums over each token's experts, in the
        original token order, from ``(M, hidden_size)`` outputs in dispatch order."""
        ...


class LocalTokenDispatcher:
    """Dispatcher without communication: every expert lives on this device.

    Args:
        num_experts: Number of experts.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._permutation: torch.Tensor | None = None
        self._routing_weights: torch.Tensor | None = None

    def dispatch(
        self, hidden: torch.Tensor, expert_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``TokenDispatcher.dispatch``."""
        permuted, tokens_per_expert, permutation = moe_permute(hidden, expert_indices, self.num_experts)
        self._permutation = permutation
        self._routing_weights = routing_weights
        return permuted, tokens_per_expert

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """See ``TokenDispatcher.combine``."""
        if self._permutation is None or self._routing_weights is None:
            raise RuntimeError("LocalTokenDispatcher.combine called before dispatch")
        combined = moe_unpermute(expert_output, self._permutation, self._routing_weights)
        self._permutation = None
        self._routing_weights = None
        return combined
