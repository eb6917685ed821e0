"""PyTorch's bundled FlashAttention 2 (``torch.nn.attention.varlen``): sliding windows with no extra."""

from __future__ import annotations

import functools
import inspect

import torch
from torch.nn.attention.varlen import varlen_attn

from d9d.kernels.layers._positions import DocumentOffsets

_MAX_HEAD_DIM = 256
# FlashAttention 2's backward over head dims above 192 needs the shared memory of an A100 or H100 class GPU
_LARGE_HEAD_DIM = 192
_LARGE_HEAD_DIM_GPUS = ((8, 0), (9, 0))


def flash_window(*, causal: bool, sliding_window: int | None) -> tuple[int, int]:
    """FlashAttention's ``(left, right)`` key counts for ``AttentionBackend``'s mask (``-1``: unbounded).

    ``|i - j| < w`` is ``(w - 1, 0)`` when causal and ``(w - 1, w - 1)`` when not.
    """
    if sliding_window is None:
        return (-1, 0) if causal else (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


class TorchFlashAttention:
    """Attention through ``torch.nn.attention.varlen.varlen_attn``: FlashAttention 2 as PyTorch builds it.

    Every row (or every packed document, from ``document_ids``) is one sequence of the varlen
    kernel, and a sliding window is the kernel's ``window_size``: the kernel skips the keys outside
    the window, as FlashAttention does, with no block mask to build and no extra to install.
    Key/value heads go in once, unrepeated: FlashAttention 2 shares each one with its query group
    itself. Newer torch versions ask for that with ``enable_gqa``; those without the flag (2.11)
    pass the heads to the same kernel unchecked (``test_flash_attention_gpu.py`` checks the values
    and gradients at Gemma's 4 query heads to 1).

    ``runs`` says whether the kernels take the inputs: a torch built with FlashAttention (not
    ROCm's or a CPU build), CUDA tensors in float16 or bfloat16, compute capability 8.0 or newer,
    head dims up to 256 in multiples of 8 (with gradients, head dims above 192 only on 8.0 and
    9.0), and a ``varlen_attn`` with ``window_size``. The caller picks another kernel otherwise.
    """

    def __init__(self) -> None:
        parameters = inspect.signature(varlen_attn).parameters
        self._available = "window_size" in parameters and torch.backends.cuda.is_flash_attention_available()
        self._grouped_attn = (
            functools.partial(varlen_attn, enable_gqa=True) if "enable_gqa" in parameters else varlen_attn
        )
        self._document_offsets = DocumentOffsets()

    def runs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether the kernels take these ``(batch, seq, heads, head_dim)`` inputs."""
        if not self._available or not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
            return False
        head_dim = query.shape[-1]
        if head_dim % 8 != 0 or head_dim > _MAX_HEAD_DIM:
            return False
        capability = torch.cuda.get_device_capability(query.device)
        if capability < (8, 0):
            return False
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return not (needs_grad and head_dim > _LARGE_HEAD_DIM and capability not in _LARGE_HEAD_DIM_GPUS)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float,
        sliding_window: int | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``AttentionBackend.attend`` for inputs that ``runs`` accepted (shapes already checked)."""
        batch, seq, q_heads, head_dim = query.shape
        if document_ids is None:
            cu_seqlens = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
            max_seqlen = seq
        else:
            cu_seqlens, max_seqlen = self._document_offsets(document_ids)
        window = flash_window(causal=causal, sliding_window=sliding_window)
        kv_heads = key.shape[2]
        attend = varlen_attn if kv_heads == q_heads else self._grouped_attn
        output = attend(
            query.reshape(batch * seq, q_heads, head_dim),
            key.reshape(batch * seq, kv_heads, head_dim),
            value.reshape(batch * seq, kv_heads, head_dim),
            cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
            scale=softmax_scale, window_size=window,
        )  # fmt: skip
        if isinstance(output, tuple):  # only with return_aux, which is not asked for
            raise TypeError("varlen_attn returned (output, lse) without return_aux")
        return output.reshape(batch, seq, q_heads, head_dim)
