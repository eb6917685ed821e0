# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""Rotary embedding Triton kernel: one program per (batch, position), all heads at once."""

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import launch_options, next_power_of_2, unit_last_stride


@triton.jit
def rotation_planes(c_row, s_row, half_dim, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr):
    """Each rotation plane's two element offsets within a head, their mask, and one position's
    cosines and sines at both (fp32)."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half_dim
    if INTERLEAVED:
        first = 2 * d
        second = 2 * d + 1
    else:
        first = d
        second = d + half_dim
    c1 = tl.load(c_row + first, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + second, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + first, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + second, mask=d_mask, other=0.0).to(tl.float32)
    return first, second, d_mask, c1, c2, s1, s2


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    seq_len,
    n_heads,
    half_dim,
    sx_b,
    sx_s,
    sx_h,
    sc_b,
    sc_s,
    ss_b,
    ss_s,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    first, second, d_mask, c1, c2, s1, s2 = rotation_planes(
        cos_ptr + b * sc_b + s * sc_s, sin_ptr + b * ss_b + s * ss_s, half_dim, INTERLEAVED, BLOCK_D
    )
    if BACKWARD:
        # The transpose of the rotation: swap the sines of the two members and negate them.
        s1, s2 = -s2, -s1
    mask = (heads[:, None] < n_heads) & d_mask[None, :]
    x_head = x_ptr + b * sx_b + s * sx_s + heads[:, None].to(tl.int64) * sx_h
    x1 = tl.load(x_head + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_head + second[None, :], mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1[None, :] - x2 * s1[None, :]
    y2 = x2 * c2[None, :] + x1 * s2[None, :]
    head_dim = 2 * half_dim
    y_head = y_ptr + ((b * seq_len + s) * n_heads + heads[:, None].to(tl.int64)) * head_dim
    tl.store(y_head + first[None, :], y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_head + second[None, :], y2.to(y_ptr.dtype.element_ty), mask=mask)


def apply_rope_kernel(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool
) -> torch.Tensor:
    """Rotates ``x`` (or, with ``backward``, applies the transposed rotation to a gradient)."""
    x, cos, sin = unit_last_stride(x), unit_last_stride(cos), unit_last_stride(sin)
    batch, seq, heads, head_dim = x.shape
    y = torch.empty((batch, seq, heads, head_dim), dtype=x.dtype, device=x.device)
    half = head_dim // 2
    block_d = next_power_of_2(half)
    block_h = min(next_power_of_2(heads), max(1, 4096 // block_d))
    grid = (batch * seq, triton.cdiv(heads, block_h))
    if y.numel() > 0:
        _rope_kernel[grid](
            x,
            cos,
            sin,
            y,
            seq,
            heads,
            half,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            cos.stride(0),
            cos.stride(1),
            sin.stride(0),
            sin.stride(1),
            **launch_options(
                INTERLEAVED=interleaved,
                BACKWARD=backward,
                BLOCK_H=block_h,
                BLOCK_D=block_d,
                num_warps=4,
            ),
        )
    return y
