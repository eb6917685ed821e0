# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""Chunked linear cross-entropy: cuBLAS matmuls per token chunk and a Triton softmax kernel.

Per chunk of tokens, one matmul writes the chunk's logits into a reused buffer; the kernel turns
each row into its loss (and log-sum-exp) and, when gradients are wanted, overwrites the row in place
with the gradient of the loss with respect to the logits, ``(softmax - onehot) * scale``; two more
matmuls fold that into the gradients of ``hidden`` and ``weight``. Only one chunk of logits exists at
a time.
"""

import torch
import triton
import triton.language as tl

from d9d.kernels._linear_cross_entropy_chunks import linear_cross_entropy_chunk_tokens
from d9d.kernels._triton.launch import launch_options

_BLOCK = 4096
_SCALE_BLOCK = 8192


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,
    stride_logits,
    labels_ptr,
    loss_ptr,
    lse_ptr,
    scale_ptr,
    scale_stride,
    n_cols,
    ignore_index,
    LSE_GIVEN: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    offsets = tl.arange(0, BLOCK)
    if LSE_GIVEN:
        lse = tl.load(lse_ptr + row)
    else:
        # Online log-sum-exp with one running maximum per lane, combined at the end.
        m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            acc = acc * tl.exp(m - safe) + tl.exp(x - safe)
            m = m_new
        m_row = tl.max(m, axis=0)
        lse = m_row + tl.log(tl.sum(acc * tl.exp(m - m_row), axis=0))
        safe_label = tl.where(ignored, 0, label)
        target = tl.load(row_ptr + safe_label).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - target))
        tl.store(lse_ptr + row, lse)
    if WRITE_GRAD:
        scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        scale = tl.where(ignored, 0.0, scale)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
            tl.store(row_ptr + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    scale = tl.load(scale_ptr).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + offsets, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


def scale_in_place(x: torch.Tensor, scale: torch.Tensor) -> None:
    """``x *= scale`` for a contiguous ``x`` and a one-element ``scale`` on its device.

    Rounds as ``x.mul_(scale)`` does (the product in fp32, stored in ``x``'s dtype), in one
    vectorized pass: PyTorch's own kernel reads a device scalar as a broadcast operand, through its
    unvectorized path (0.89 ms for Gemma-3's 262144 x 1152 head gradient on an H100).
    """
    if not x.is_contiguous():
        raise ValueError(f"scale_in_place: x of shape {tuple(x.shape)} is not contiguous")
    if scale.numel() != 1:
        raise ValueError(f"scale_in_place: scale has {scale.numel()} elements, expected 1")
    n = x.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, _SCALE_BLOCK),)
    _scale_kernel[grid](x, scale, n, **launch_options(BLOCK=_SCALE_BLOCK, num_warps=8))


def _chunk_rows(n_rows: int, n_cols: int, element_size: int, chunk_size: int) -> int:
    if chunk_size > 0:
        return max(1, min(n_rows, chunk_size))
    return linear_cross_entropy_chunk_tokens(n_rows, n_cols, element_size)


def _run_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    lse_given: bool,
    write_grad: bool,
) -> None:
    scale_stride = 1 if scale.numel() > 1 else 0
    _cross_entropy_rows_kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        labels,
        loss,
        lse,
        scale,
        scale_stride,
        logits.shape[1],
        ignore_index,
        **launch_options(LSE_GIVEN=lse_given, WRITE_GRAD=write_grad, BLOCK=_BLOCK, num_warps=16),
    )


def linear_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    grad_scale: torch.Tensor,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token losses and log-sum-exps; gradients scaled by ``grad_scale`` when asked for.

    Returns ``(loss, lse, hidden_grad, weight_grad)``; a gradient not asked for is an empty tensor.
    ``weight_grad`` accumulates over chunks in ``weight``'s dtype (one rounding per chunk in bf16).
    """
    n_rows, n_cols = hidden.shape[0], weight.shape[0]
    loss = torch.empty((n_rows,), dtype=torch.float32, device=hidden.device)
    lse = torch.empty((n_rows,), dtype=torch.float32, device=hidden.device)
    write_grad = need_hidden_grad or need_weight_grad
    hidden_grad = torch.empty_like(hidden) if need_hidden_grad else hidden.new_empty((0,))
    weight_grad = torch.empty_like(weight) if need_weight_grad else weight.new_empty((0,))
    if n_rows == 0:
        if need_weight_grad:
            weight_grad.zero_()
        return loss, lse, hidden_grad, weight_grad
    chunk = _chunk_rows(n_rows, n_cols, hidden.element_size(), chunk_size)
    buffer = torch.empty((chunk, n_cols), dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        h = hidden[start:end]
        logits = buffer[: end - start]
        torch.mm(h, weight.T, out=logits)
        scale = grad_scale[start:end] if grad_scale.numel() > 1 else grad_scale
        _run_rows(
            logits, labels[start:end], loss[start:end], lse[start:end], scale, ignore_index, False, write_grad
        )
        if need_hidden_grad:
            torch.mm(logits, weight, out=hidden_grad[start:end])
        if need_weight_grad:
            if start == 0:
                torch.mm(logits.T, h, out=weight_grad)
            else:
                weight_grad.addmm_(logits.T, h)
    return loss, lse, hidden_grad, weight_grad


def linear_cross_entropy_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    ignore_index: int,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients for per-token upstream gradients ``grad_loss`` (N,), recomputing the logits."""
    n_rows, n_cols = hidden.shape[0], weight.shape[0]
    hidden_grad = torch.empty_like(hidden) if need_hidden_grad else hidden.new_empty((0,))
    weight_grad = torch.zeros_like(weight) if need_weight_grad else weight.new_empty((0,))
    if n_rows == 0:
        return hidden_grad, weight_grad
    scale = grad_loss.float().contiguous()
    unused_loss = torch.empty((n_rows,), dtype=torch.float32, device=hidden.device)
    chunk = _chunk_rows(n_rows, n_cols, hidden.element_size(), chunk_size)
    buffer = torch.empty((chunk, n_cols), dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        h = hidden[start:end]
        logits = buffer[: end - start]
        torch.mm(h, weight.T, out=logits)
        _run_rows(
            logits,
            labels[start:end],
            unused_loss[start:end],
            lse[start:end],
            scale[start:end],
            ignore_index,
            True,
            True,
        )
        if need_hidden_grad:
            torch.mm(logits, weight, out=hidden_grad[start:end])
        if need_weight_grad:
            weight_grad.addmm_(logits.T, h)
    return hidden_grad, weight_grad
