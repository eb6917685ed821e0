# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrapper below still carries full annotations.
"""Per-head RMSNorm and rotary embedding of queries and keys in one launch (inference).

One program per (batch, position, tensor): the first of each position's two programs takes every
query head, the second every key head. A head's norm is rounded to the output dtype before it is
rotated, as the separate ``rms_norm`` then ``apply_rope`` round it, so the result is theirs up to the
order of one fp32 sum.
"""

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import launch_options, next_power_of_2, unit_last_stride
from d9d.kernels._triton.rope_kernels import rotation_planes


@triton.jit
def _norm_and_rotate(
    x_ptr, w_ptr, y_ptr, c1, c2, s1, s2, b, s, seq_len, n_heads, half_dim, eps, sx_b, sx_s, sx_h,
    first, second, d_mask, ZERO_CENTERED: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < n_heads) & d_mask[None, :]
    x_head = x_ptr + b * sx_b + s * sx_s + heads[:, None].to(tl.int64) * sx_h
    x1 = tl.load(x_head + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_head + second[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half_dim) + eps)
    w1 = tl.load(w_ptr + first, mask=d_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + second, mask=d_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w1 = w1 + 1.0
        w2 = w2 + 1.0
    out_dtype = y_ptr.dtype.element_ty
    n1 = (x1 * rstd[:, None] * w1[None, :]).to(out_dtype).to(tl.float32)
    n2 = (x2 * rstd[:, None] * w2[None, :]).to(out_dtype).to(tl.float32)
    y1 = n1 * c1[None, :] - n2 * s1[None, :]
    y2 = n2 * c2[None, :] + n1 * s2[None, :]
    y_head = y_ptr + ((b * seq_len + s) * n_heads + heads[:, None].to(tl.int64)) * (2 * half_dim)
    tl.store(y_head + first[None, :], y1.to(out_dtype), mask=mask)
    tl.store(y_head + second[None, :], y2.to(out_dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qy_ptr, ky_ptr,
    seq_len, q_heads, k_heads, half_dim, eps,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sc_b, sc_s, ss_b, ss_s,
    INTERLEAVED: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = (pid // seq_len).to(tl.int64)
    s = (pid % seq_len).to(tl.int64)
    first, second, d_mask, c1, c2, s1, s2 = rotation_planes(
        cos_ptr + b * sc_b + s * sc_s, sin_ptr + b * ss_b + s * ss_s, half_dim, INTERLEAVED, BLOCK_D
    )
    if tl.program_id(1) == 0:
        _norm_and_rotate(
            q_ptr, qw_ptr, qy_ptr, c1, c2, s1, s2, b, s, seq_len, q_heads, half_dim, eps, sq_b, sq_s, sq_h,
            first, second, d_mask, ZERO_CENTERED, BLOCK_H,
        )  # fmt: skip
    else:
        _norm_and_rotate(
            k_ptr, kw_ptr, ky_ptr, c1, c2, s1, s2, b, s, seq_len, k_heads, half_dim, eps, sk_b, sk_s, sk_h,
            first, second, d_mask, ZERO_CENTERED, BLOCK_H,
        )  # fmt: skip


def qk_norm_rope_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    zero_centered: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalizes and rotates ``query`` and ``key`` (shapes checked by the public op)."""
    query, key = unit_last_stride(query), unit_last_stride(key)
    cos, sin = unit_last_stride(cos), unit_last_stride(sin)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    batch, seq, q_heads, head_dim = query.shape
    k_heads = key.shape[2]
    q_out = torch.empty((batch, seq, q_heads, head_dim), dtype=query.dtype, device=query.device)
    k_out = torch.empty((batch, seq, k_heads, head_dim), dtype=key.dtype, device=key.device)
    if batch * seq == 0:
        return q_out, k_out
    half = head_dim // 2
    block_h = next_power_of_2(max(q_heads, k_heads))
    _qk_norm_rope_kernel[(batch * seq, 2)](
        query, key, q_weight, k_weight, cos, sin, q_out, k_out,
        seq, q_heads, k_heads, half, eps,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        **launch_options(
            INTERLEAVED=interleaved, ZERO_CENTERED=zero_centered, BLOCK_H=block_h,
            BLOCK_D=next_power_of_2(half), num_warps=4 if block_h * half <= 2048 else 8,
        ),
    )  # fmt: skip
    return q_out, k_out
