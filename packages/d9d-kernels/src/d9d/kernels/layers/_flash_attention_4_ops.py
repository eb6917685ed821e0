"""FlashAttention 4's dense kernels as custom ops, so a compiled layer keeps one graph around them.

``flash_attn.cute.flash_attn_func`` is an autograd function over CuTe DSL launches that
``torch.compile`` cannot trace: each call splits the layer's graph in two, and the gradient of the
residual stream is then summed at the break in eager mode (Gemma-3-1B on an H100: about 2.2 ms a
step of extra kernels). These ops call the package's forward and backward launchers
(``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``, checked against
``flash-attn-4`` 4.0.0b36) as opaque nodes with fake shapes, and are differentiable in the query,
key and value. ``launchers_available`` says whether the installed version has them; the backend
falls back to ``flash_attn_func`` otherwise.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

_INTERFACE = "flash_attn.cute.interface"
_LAUNCHERS = ("_flash_attn_fwd", "_flash_attn_bwd")


def _interface() -> ModuleType:
    return importlib.import_module(_INTERFACE)


def launchers_available() -> bool:
    """Whether ``flash_attn.cute.interface`` is importable and has both launchers these ops call."""
    try:
        interface = _interface()
    except ImportError:
        return False
    return all(callable(getattr(interface, name, None)) for name in _LAUNCHERS)


@torch.library.custom_op("d9d_kernels::flash_attention_4_forward", mutates_args=())
def _forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    result = _interface()._flash_attn_fwd(
        query, key, value, softmax_scale=softmax_scale, causal=causal,
        window_size_left=window_left, window_size_right=window_right, return_lse=True,
    )  # fmt: skip
    return result[0], result[1]


@_forward.register_fake
def _forward_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, heads, _ = query.shape
    output = query.new_empty((batch, seq, heads, value.shape[-1]))
    log_sum_exp = query.new_empty((batch, heads, seq), dtype=torch.float32)
    return output, log_sum_exp


@torch.library.custom_op("d9d_kernels::flash_attention_4_backward", mutates_args=())
def _backward_op(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    log_sum_exp: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    result = _interface()._flash_attn_bwd(
        query, key, value, output, grad_output.contiguous(), log_sum_exp, softmax_scale, causal, 0.0,
        window_size_left=window_left, window_size_right=window_right,
    )  # fmt: skip
    return result[0], result[1], result[2]


@_backward_op.register_fake
def _backward_fake(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    log_sum_exp: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    query, key, value, softmax_scale, causal, window_left, window_right = inputs
    ctx.save_for_backward(query, key, value, *output)
    ctx.options = (softmax_scale, causal, window_left, window_right)


def _backward(ctx: Any, grad_output: torch.Tensor, _grad_log_sum_exp: torch.Tensor | None) -> tuple[Any, ...]:
    query, key, value, output, log_sum_exp = ctx.saved_tensors
    grads = _backward_op(grad_output, query, key, value, output, log_sum_exp, *ctx.options)
    return (*grads, None, None, None, None)


_forward.register_autograd(_backward, setup_context=_setup_context)


def flash_attention_4(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    window: tuple[int | None, int | None],
) -> torch.Tensor:
    """FlashAttention 4 over ``(batch, seq, heads, head_dim)`` inputs; ``window`` is ``(left, right)``
    (``None``: unbounded). Returns the output only (the log-sum-exp is kept for backward)."""
    output, _ = _forward(query, key, value, softmax_scale, causal, window[0], window[1])
    return output
