"""MoE permute / unpermute as ``torch.library`` custom ops with autograd."""

from typing import Any

import torch


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(permutation.shape[0], device=permutation.device)
    return torch.empty_like(permutation).scatter_(0, permutation, positions)


@torch.library.custom_op("d9d_kernels::moe_permute", mutates_args=())
def _permute(
    hidden: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.moe_kernels import scatter_rows

    flat = expert_indices.reshape(-1)
    permutation = torch.argsort(flat, stable=True)
    # scatter_add instead of bincount: no host sync on CUDA.
    counts = torch.zeros((num_experts,), dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    inverse = _inverse(permutation)
    permuted = scatter_rows(hidden.contiguous(), inverse, expert_indices.shape[1])
    return permuted, counts, permutation, inverse


@_permute.register_fake
def _permute_fake(
    hidden: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pairs = expert_indices.numel()
    return (
        hidden.new_empty((pairs, hidden.shape[1])),
        expert_indices.new_empty((num_experts,)),
        expert_indices.new_empty((pairs,)),
        expert_indices.new_empty((pairs,)),
    )


@torch.library.custom_op("d9d_kernels::moe_gather_sum", mutates_args=())
def _gather_sum(src: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    from d9d.kernels._triton.moe_kernels import gather_sum

    return gather_sum(src.contiguous(), inverse, None, top_k)


@_gather_sum.register_fake
def _gather_sum_fake(src: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    return src.new_empty((inverse.shape[0] // top_k, src.shape[1]))


def _permute_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    ctx.save_for_backward(output[3])
    ctx.top_k = inputs[1].shape[1]


def _permute_backward(ctx: Any, dpermuted: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
    (inverse,) = ctx.saved_tensors
    return _gather_sum(dpermuted, inverse, ctx.top_k), None, None


_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("d9d_kernels::moe_unpermute", mutates_args=())
def _unpermute(
    permuted_output: torch.Tensor, permutation: torch.Tensor, routing_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.moe_kernels import gather_sum

    inverse = _inverse(permutation)
    out = gather_sum(
        permuted_output.contiguous(), inverse, routing_weights.contiguous(), routing_weights.shape[1]
    )
    return out, inverse


@_unpermute.register_fake
def _unpermute_fake(
    permuted_output: torch.Tensor, permutation: torch.Tensor, routing_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return permuted_output.new_empty((routing_weights.shape[0], permuted_output.shape[1])), torch.empty_like(
        permutation
    )


@torch.library.custom_op("d9d_kernels::moe_unpermute_backward", mutates_args=())
def _unpermute_backward_op(
    dout: torch.Tensor, permuted_output: torch.Tensor, inverse: torch.Tensor, routing_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.moe_kernels import unpermute_backward

    return unpermute_backward(
        dout.contiguous(), permuted_output.contiguous(), inverse, routing_weights.contiguous()
    )


@_unpermute_backward_op.register_fake
def _unpermute_backward_fake(
    dout: torch.Tensor, permuted_output: torch.Tensor, inverse: torch.Tensor, routing_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(permuted_output), torch.empty_like(routing_weights)


def _unpermute_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    permuted_output, _, routing_weights = inputs
    ctx.save_for_backward(permuted_output, output[1], routing_weights)


def _unpermute_backward(ctx: Any, dout: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
    permuted_output, inverse, routing_weights = ctx.saved_tensors
    dsrc, dweights = _unpermute_backward_op(dout, permuted_output, inverse, routing_weights)
    return dsrc, None, dweights


_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def moe_permute_triton(
    hidden: torch.Tensor, expert_indices: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token permutation through the Triton kernels; see ``d9d.kernels.moe_permute``."""
    permuted, counts, permutation, _ = _permute(hidden, expert_indices, num_experts)
    return permuted, counts, permutation


def moe_unpermute_triton(
    permuted_output: torch.Tensor, permutation: torch.Tensor, routing_weights: torch.Tensor
) -> torch.Tensor:
    """Weighted un-permutation through the Triton kernels; see ``d9d.kernels.moe_unpermute``."""
    out, _ = _unpermute(permuted_output, permutation, routing_weights)
    return out
