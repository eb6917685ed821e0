"""The MoE dispatcher slot as d9d-parallel sees it, and its all-to-all implementation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from d9d.parallel._all_to_all import all_to_all


class TokenDispatcher(Protocol):
    """Moves routed tokens to their experts and the results back (a MoE layer's ``dispatcher``).

    The meaning is d9d-kernels' ``TokenDispatcher`` (docs/kernels-layers.md, "Mixture of
    experts"); in short: ``dispatch`` takes hidden states (T, H), global expert ids (T, K) and
    routing weights (T, K) and returns the tokens this rank's experts must process, grouped
    contiguously by local expert, with their counts (E_local,). ``combine`` takes the experts'
    output rows in that order and returns (T, H): for each token, the routing-weighted sum of its
    K results. A dispatcher keeps the state of one call between ``dispatch`` and ``combine``.
    """

    def dispatch(
        self, hidden: torch.Tensor, expert_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True)
class _DispatchState:
    order: torch.Tensor
    regroup: torch.Tensor
    send_splits: list[int]
    receive_splits: list[int]
    routing_weights: torch.Tensor


class AllToAllTokenDispatcher:
    """Expert-parallel dispatcher: an all-to-all over the ep group with uneven splits.

    Rank ``r`` of the group holds global experts ``[r * E_local, (r + 1) * E_local)``. Dispatch
    sorts this rank's (token, k) pairs by expert, exchanges the per-expert counts, sends each
    rank the rows for its experts and regroups what arrives by local expert; combine undoes
    each step in reverse. Both exchanges are differentiable, so gradients reach the hidden
    states and routing weights on the ranks the tokens came from. Works on any backend that
    has ``all_to_all_single`` (NCCL, gloo).
    """

    def __init__(self, *, num_experts: int, group: ProcessGroup) -> None:
        """Args:
        num_experts: Global expert count; divisible by the group's size.
        group: The expert-parallel process group.
        """
        size = dist.get_world_size(group)
        if num_experts % size != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel degree {size}"
            )
        self._num_experts = num_experts
        self._group = group
        self._ranks = size
        self._local_experts = num_experts // size
        self._state: _DispatchState | None = None

    def dispatch(
        self, hidden: torch.Tensor, expert_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sends each (token, k) row to the rank holding its expert; see the class docstring."""
        top_k = expert_indices.shape[-1]
        flat_experts = expert_indices.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        permuted = hidden[order // top_k]
        tokens_per_expert = torch.bincount(flat_experts, minlength=self._num_experts)
        send_counts = tokens_per_expert.view(self._ranks, self._local_experts)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts.contiguous(), group=self._group)
        send_splits = cast(list[int], send_counts.sum(dim=1).tolist())
        receive_splits = cast(list[int], receive_counts.sum(dim=1).tolist())
        received = all_to_all(
            permuted, output_splits=receive_splits, input_splits=send_splits, group=self._group
        )
        # Rows arrive by source rank, then by local expert; regroup them by local expert.
        local_expert = torch.arange(self._local_experts, device=hidden.device).repeat(self._ranks)
        row_expert = torch.repeat_interleave(local_expert, receive_counts.reshape(-1))
        regroup = torch.argsort(row_expert, stable=True)
        self._state = _DispatchState(
            order=order,
            regroup=regroup,
            send_splits=send_splits,
            receive_splits=receive_splits,
            routing_weights=routing_weights,
        )
        return received[regroup], receive_counts.sum(dim=0)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Returns expert results to their tokens' ranks and sums them with the routing weights."""
        state = self._state
        if state is None:
            raise RuntimeError("AllToAllTokenDispatcher.combine called without a preceding dispatch")
        self._state = None
        by_source = expert_output[torch.argsort(state.regroup)]
        returned = all_to_all(
            by_source, output_splits=state.send_splits, input_splits=state.receive_splits, group=self._group
        )
        rows = returned[torch.argsort(state.order)]
        tokens, top_k = state.routing_weights.shape
        weighted = rows.view(tokens, top_k, -1) * state.routing_weights.unsqueeze(-1).to(rows.dtype)
        return weighted.sum(dim=1)
