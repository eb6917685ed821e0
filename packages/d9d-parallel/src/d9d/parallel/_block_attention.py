"""Attention of one query block over key blocks, merged through their log-sum-exp.

Context parallelism gives a rank query chunks that attend to every earlier key plus their own
chunk causally: a lower-right causal mask over a longer key range. PyTorch's public SDPA sends
that mask (``CausalBias``) to its FlashAttention-2 kernel, about half the speed of the cuDNN
kernel that plain causal attention gets on Hopper. Split into a square causal block and an
unmasked prefix block, both run on the fast kernel; their outputs are merged with their
log-sum-exps, and the backward runs each block's backward against the merged output and
log-sum-exp (exact: the softmax normalizer of the merged row is what each block's gradient needs).

Only PyTorch's underscore SDPA ops return the log-sum-exp (there is no public API for it), so the
kernels live behind ``BlockAttentionKernel``: cuDNN on CUDA, PyTorch's flash kernel for CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

_aten = torch.ops.aten


@dataclass(frozen=True)
class BlockResult:
    """One block's attention: output (batch, heads, q_len, dim), float32 log-sum-exp
    (batch, heads, q_len), and what the kernel's backward needs besides (opaque to callers)."""

    out: torch.Tensor
    lse: torch.Tensor
    saved: tuple[Any, ...]


class BlockAttentionKernel(Protocol):
    """Attention of one block that also returns its log-sum-exp, and that block's backward.

    Tensors are (batch, heads, seq, dim); key and value may have fewer heads than the query
    (grouped-query attention), dividing them. ``causal`` is only asked of square blocks.
    """

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool, scale: float
    ) -> BlockResult:
        """Output and float32 log-sum-exp of ``softmax(q k^T * scale) v``."""
        ...

    def backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        merged: BlockResult,
        saved: tuple[Any, ...],
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of query, key and value, given the merged row's output and log-sum-exp."""
        ...


class CudnnBlockAttention:
    """cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention``), CUDA sm80+."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool, scale: float
    ) -> BlockResult:
        """See ``BlockAttentionKernel.forward``."""
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, causal, False, scale=scale
        )
        lse_shape = tuple(lse.shape)
        return BlockResult(
            out=out,
            lse=lse.reshape(query.shape[:3]).float(),
            saved=(lse_shape, lse.dtype, cum_q, cum_k, max_q, max_k, seed, offset),
        )

    def backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        merged: BlockResult,
        saved: tuple[Any, ...],
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See ``BlockAttentionKernel.backward``."""
        lse_shape, lse_dtype, cum_q, cum_k, max_q, max_k, seed, offset = saved
        lse = merged.lse.to(lse_dtype).reshape(lse_shape)
        grads = _aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, query, key, value, merged.out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
            causal, scale=scale,
        )  # fmt: skip
        return cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple(grads))


class CpuFlashBlockAttention:
    """PyTorch's CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``)."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool, scale: float
    ) -> BlockResult:
        """See ``BlockAttentionKernel.forward``."""
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            query,
            expand_heads(key, query.shape[1], dim=1),
            expand_heads(value, query.shape[1], dim=1),
            0.0,
            causal,
            scale=scale,
        )
        return BlockResult(out=out, lse=lse.float(), saved=(lse.dtype,))

    def backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        merged: BlockResult,
        saved: tuple[Any, ...],
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See ``BlockAttentionKernel.backward``."""
        (lse_dtype,) = saved
        grad_q, grad_k, grad_v = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out,
            query,
            expand_heads(key, query.shape[1], dim=1),
            expand_heads(value, query.shape[1], dim=1),
            merged.out,
            merged.lse.to(lse_dtype),
            0.0,
            causal,
            scale=scale,
        )
        return grad_q, _fold(grad_k, key), _fold(grad_v, value)


def expand_heads(states: torch.Tensor, q_heads: int, *, dim: int) -> torch.Tensor:
    """Key/value heads (along ``dim``) repeated for their query groups, to ``q_heads`` heads."""
    return states.repeat_interleave(q_heads // states.shape[dim], dim=dim)


def _fold(grad: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """Sums the gradients of the repeated heads back onto each key/value head."""
    b, kv_heads, seq, dim = states.shape
    return grad.view(b, kv_heads, -1, seq, dim).sum(2)


def block_attention_kernel_for(query: torch.Tensor) -> BlockAttentionKernel | None:
    """The kernel for attention over ``query``'s device, dtype and head size, or None where there is
    none (the caller then masks)."""
    match query.device.type:
        case "cuda":
            # cuDNN's fused attention: half precision, head sizes of 8k up to 128, Ampere or newer.
            fits = query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] % 8 == 0
            fits = fits and query.shape[-1] <= 128 and torch.backends.cudnn.is_available()
            return (
                CudnnBlockAttention()
                if fits and torch.cuda.get_device_capability(query.device) >= (8, 0)
                else None
            )
        case "cpu":
            return CpuFlashBlockAttention()
        case _:
            return None


def _sequence_major_like(query: torch.Tensor) -> torch.Tensor:
    """An empty (batch, heads, seq, dim) tensor stored as (batch, seq, heads, dim), as attention
    layers lay out their heads; the merged output and its gradient share it for the kernels."""
    b, h, s, d = query.shape
    return query.new_empty((b, s, h, d)).transpose(1, 2)


def _merge(first: BlockResult, second: BlockResult) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 output and log-sum-exp of attention over the union of two key blocks."""
    lse = torch.logaddexp(first.lse, second.lse)
    out = first.out.float() * torch.exp(first.lse - lse).unsqueeze(-1)
    out = out + second.out.float() * torch.exp(second.lse - lse).unsqueeze(-1)
    return out, lse


class _PrefixCausalAttention(torch.autograd.Function):
    """Queries of one chunk over keys ``[0, start + q_len)``, causal within their own chunk.

    The first chunk (``start == 0``) runs here too rather than through SDPA's autograd: on torch
    2.11 with CUDA bf16, SDPA's causal backward with ``enable_gqa`` gave wrong gradients for a
    query chunk sliced out of a batch of two (forward equal to the reference, gradients off by up
    to their own size); with the key/value heads expanded it was right.
    """

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        start: int,
        scale: float,
        kernel: BlockAttentionKernel,
    ) -> torch.Tensor:
        length = query.shape[2]
        own = slice(start, start + length)
        diagonal = kernel.forward(query, key[:, :, own], value[:, :, own], causal=True, scale=scale)
        if start > 0:
            prefix = kernel.forward(query, key[:, :, :start], value[:, :, :start], causal=False, scale=scale)
            out32, lse = _merge(diagonal, prefix)
            saved_state = (diagonal.saved, prefix.saved)
        else:
            out32, lse, saved_state = diagonal.out, diagonal.lse, (diagonal.saved, ())
        out = _sequence_major_like(query)
        out.copy_(out32)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.saved_kernel_state = saved_state
        ctx.start, ctx.scale, ctx.kernel = start, scale, kernel
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, out, lse = cast(tuple[torch.Tensor, ...], ctx.saved_tensors)
        start, scale = cast(int, ctx.start), cast(float, ctx.scale)
        kernel = cast(BlockAttentionKernel, ctx.kernel)
        diagonal_saved, prefix_saved = cast(tuple[tuple[Any, ...], tuple[Any, ...]], ctx.saved_kernel_state)
        grad_out = _sequence_major_like(query)
        grad_out.copy_(grad_outputs[0])
        merged = BlockResult(out=out, lse=lse, saved=())
        own = slice(start, start + query.shape[2])
        prefix = slice(0, start)
        grad_q, grad_k_own, grad_v_own = kernel.backward(
            grad_out,
            query,
            key[:, :, own],
            value[:, :, own],
            merged,
            diagonal_saved,
            causal=True,
            scale=scale,
        )
        grad_key = key.new_zeros(key.shape)
        grad_value = value.new_zeros(value.shape)
        grad_key[:, :, own] = grad_k_own
        grad_value[:, :, own] = grad_v_own
        if start > 0:
            grad_q_prefix, grad_key[:, :, prefix], grad_value[:, :, prefix] = kernel.backward(
                grad_out,
                query,
                key[:, :, prefix],
                value[:, :, prefix],
                merged,
                prefix_saved,
                causal=False,
                scale=scale,
            )
            grad_q = grad_q + grad_q_prefix
        return grad_q, grad_key, grad_value, None, None, None


def attend_chunk_causally(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    start: int,
    scale: float,
    kernel: BlockAttentionKernel,
) -> torch.Tensor:
    """Queries at positions ``[start, start + q_len)`` over keys ``[0, start + q_len)``, causally.

    Equals SDPA with a lower-right ``CausalBias`` over ``key[:, :, :start + q_len]``; differentiable in
    query, key and value (the key and value gradients are zero past ``start + q_len``).

    Args:
        query: (batch, heads, q_len, dim).
        key: (batch, kv_heads, kv_len, dim) with ``kv_len >= start + q_len``.
        value: Like ``key``.
        start: Position of the first query (and of its own key).
        scale: Softmax scale.
        kernel: The block kernel (``block_attention_kernel_for``).
    """
    return cast(torch.Tensor, _PrefixCausalAttention.apply(query, key, value, start, scale, kernel))
