"""Expert-parallel token dispatch through DeepEP's NVLink kernels, differentiable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from d9d.parallel._deep_ep_buffer import DeepEPBuffer, DeepEPBuffers


@dataclass(kw_only=True)
class _Exchange:
    """One dispatch's buffer and DeepEP handle, shared by its forward and both backwards."""

    buffer: DeepEPBuffer
    num_experts: int
    handle: object = field(default=None)


class _Dispatch(torch.autograd.Function):
    """Forward: DeepEP dispatch. Backward: combine of the gradients along the same handle."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        routing_weights: torch.Tensor,
        expert_indices: torch.Tensor,
        exchange: _Exchange,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buffer = exchange.buffer
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            expert_indices, exchange.num_experts
        )
        received, local_indices, local_weights, _, handle, _ = buffer.dispatch(
            hidden,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=expert_indices,
            topk_weights=routing_weights,
        )
        if local_indices is None or local_weights is None or handle is None:
            raise RuntimeError("DeepEP's dispatch returned no top-k ids, weights or handle")
        exchange.handle = handle
        ctx.exchange = exchange
        ctx.mark_non_differentiable(local_indices)
        return received, local_weights, local_indices

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        grad_received, grad_weights = grads[0], grads[1]
        exchange: _Exchange = ctx.exchange
        if grad_received is None:
            return None, None, None, None
        weights = None if grad_weights is None else grad_weights.float().contiguous()
        grad_hidden, grad_routing, _ = exchange.buffer.combine(
            grad_received.contiguous(), exchange.handle, topk_weights=weights
        )
        return grad_hidden, grad_routing, None, None


class _Combine(torch.autograd.Function):
    """Forward: DeepEP combine. Backward: dispatch of the gradients along the same handle."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, exchange: _Exchange) -> torch.Tensor:
        ctx.exchange = exchange
        combined, _, _ = exchange.buffer.combine(rows, exchange.handle)
        return combined

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        exchange: _Exchange = ctx.exchange
        received, *_ = exchange.buffer.dispatch(grads[0].contiguous(), handle=exchange.handle)
        return received, None


@dataclass(frozen=True, kw_only=True)
class _DispatchState:
    exchange: _Exchange
    rows: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor
    received: int
    dtype: torch.dtype


class DeepEPTokenDispatcher:
    """Expert-parallel dispatcher over DeepEP's intranode (NVLink) all-to-all kernels.

    Rank ``r`` of the group holds global experts ``[r * E_local, (r + 1) * E_local)``, as with
    ``AllToAllTokenDispatcher``, and the two give the same results. Dispatch sends each token
    once to every rank that holds one of its experts (not once per expert), together with its
    routing weights; that rank copies the token for each of its local experts and groups the
    copies by expert. Combine weights each copy, sums a token's copies on the expert's rank and
    lets DeepEP sum the ranks' partial results on the token's own rank. Backward runs the
    reverse DeepEP call with the same handle (dispatch's backward is a combine and combine's a
    dispatch), so gradients reach the hidden states and routing weights where they came from.

    DeepEP takes CUDA bfloat16 hidden states on at most 8 ranks of one host (NVLink); other
    inputs are a ValueError. DeepEP is built from source (docs/parallel.md, "DeepEP
    dispatcher"); without it, constructing this class raises an ImportError saying so.
    """

    def __init__(
        self, *, num_experts: int, group: ProcessGroup, buffers: DeepEPBuffers | None = None
    ) -> None:
        """Args:
        num_experts: Global expert count; divisible by the group's size.
        group: The expert-parallel process group.
        buffers: DeepEP buffers to share with other layers; a private one when None.
        """
        size = dist.get_world_size(group)
        if num_experts % size != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel degree {size}"
            )
        self._num_experts = num_experts
        self._local_experts = num_experts // size
        self._group = group
        self._buffers = buffers if buffers is not None else DeepEPBuffers()
        self._state: _DispatchState | None = None

    def dispatch(
        self, hidden: torch.Tensor, expert_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sends tokens to the ranks of their experts and groups the copies by local expert."""
        if hidden.ndim != 2 or expert_indices.shape != routing_weights.shape or expert_indices.ndim != 2:
            raise ValueError(
                f"DeepEPTokenDispatcher.dispatch takes hidden (T, H) and expert ids and weights (T, K); "
                f"got {tuple(hidden.shape)}, {tuple(expert_indices.shape)}, {tuple(routing_weights.shape)}"
            )
        buffer = self._buffers.buffer_for(self._group, hidden)
        exchange = _Exchange(buffer=buffer, num_experts=self._num_experts)
        received, weights, local_indices = cast(
            tuple[torch.Tensor, torch.Tensor, torch.Tensor],
            _Dispatch.apply(
                hidden.contiguous(),
                routing_weights.float().contiguous(),
                expert_indices.long().contiguous(),
                exchange,
            ),
        )
        # Copies of each received token, one per local expert, ordered by expert and then by
        # arrival (source rank, then token order), as the all-to-all dispatcher orders them.
        rows, slots = (local_indices >= 0).nonzero(as_tuple=True)
        experts = local_indices[rows, slots]
        order = torch.argsort(experts, stable=True)
        rows, slots = rows[order], slots[order]
        self._state = _DispatchState(
            exchange=exchange,
            rows=rows,
            slots=slots,
            weights=weights,
            received=received.shape[0],
            dtype=hidden.dtype,
        )
        return received[rows], torch.bincount(experts, minlength=self._local_experts)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Weights and sums each token's expert outputs and returns them to the token's rank."""
        state = self._state
        if state is None:
            raise RuntimeError("DeepEPTokenDispatcher.combine called without a preceding dispatch")
        self._state = None
        weighted = expert_output.float() * state.weights[state.rows, state.slots].unsqueeze(-1)
        partial = weighted.new_zeros(state.received, weighted.shape[-1]).index_add(0, state.rows, weighted)
        return cast(torch.Tensor, _Combine.apply(partial.to(state.dtype), state.exchange))
