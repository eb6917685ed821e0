# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""Per-head RMSNorm and rotary embedding of queries and keys in one launch each way.

A head of one position is a row; a program takes a tile of rows of one tensor (the query tiles
first, then the key tiles), so a training step's thousands of positions move in tiles of a few
kilobytes, and a decode step's few rows in one or two programs. A head's norm is rounded to the
output dtype before it is rotated, as the separate ``rms_norm`` then ``apply_rope`` round it, so the
result is theirs up to the order of one fp32 sum.
"""

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import launch_options, next_power_of_2, unit_last_stride
from d9d.kernels._triton.rms_norm_kernels import BACKWARD_PROGRAMS_PER_SM, multiprocessor_count, sum_partials
from d9d.kernels._triton.rope_kernels import rotation_planes

_TILE_ROWS = 16
"""Head rows a tile: the fastest both ways at Gemma-3-1B's and Qwen3-0.6B's heads on an H100."""
_WIDE_HEAD_DIM = 256
_WIDE_HEAD_PROGRAMS_PER_SM = 2
"""The backward's persistent programs an SM from ``_WIDE_HEAD_DIM`` up: at Gemma-3-1B's heads (256)
74.6 us against 81.1 at ``BACKWARD_PROGRAMS_PER_SM``; at Qwen3-0.6B's (128) 4 was the fastest (H100)."""


def backward_programs_per_sm(head_dim: int) -> int:
    """The backward's persistent programs an SM for heads ``head_dim`` wide."""
    return _WIDE_HEAD_PROGRAMS_PER_SM if head_dim >= _WIDE_HEAD_DIM else BACKWARD_PROGRAMS_PER_SM


@triton.jit
def _tile(
    cos_ptr, sin_ptr, tile, n_rows, n_heads, seq_len, half_dim, sc_b, sc_s, ss_b, ss_s,
    INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """A tile's rows, each row's batch, position and head, the mask, and the rotation planes.

    Rows past the end take the last row's place (in bounds) and are masked out of the loads of the
    inputs and of every store.
    """
    rows = tile.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    safe = tl.minimum(rows, n_rows - 1)
    position = safe // n_heads
    b = position // seq_len
    s = position % seq_len
    first, second, d_mask, c1, c2, s1, s2 = rotation_planes(
        cos_ptr + (b * sc_b + s * sc_s)[:, None], sin_ptr + (b * ss_b + s * ss_s)[:, None],
        half_dim, INTERLEAVED, BLOCK_D,
    )  # fmt: skip
    mask = row_mask[:, None] & d_mask[None, :]
    return rows, b, s, safe % n_heads, first, second, d_mask, mask, c1, c2, s1, s2


@triton.jit
def _weight_halves(w_ptr, first, second, d_mask, ZERO_CENTERED: tl.constexpr):
    w1 = tl.load(w_ptr + first, mask=d_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + second, mask=d_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w1 = w1 + 1.0
        w2 = w2 + 1.0
    return w1, w2


@triton.jit
def _norm_and_rotate(
    x_ptr, w_ptr, y_ptr, cos_ptr, sin_ptr, tile, n_rows, n_heads, seq_len, half_dim, eps,
    sx_b, sx_s, sx_h, sc_b, sc_s, ss_b, ss_s,
    INTERLEAVED: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows, b, s, head, first, second, d_mask, mask, c1, c2, s1, s2 = _tile(
        cos_ptr, sin_ptr, tile, n_rows, n_heads, seq_len, half_dim, sc_b, sc_s, ss_b, ss_s, INTERLEAVED,
        BLOCK_R, BLOCK_D,
    )  # fmt: skip
    x_row = b * sx_b + s * sx_s + head * sx_h
    x1 = tl.load(x_ptr + x_row[:, None] + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row[:, None] + second[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half_dim) + eps)
    w1, w2 = _weight_halves(w_ptr, first, second, d_mask, ZERO_CENTERED)
    out_dtype = y_ptr.dtype.element_ty
    n1 = (x1 * rstd[:, None] * w1[None, :]).to(out_dtype).to(tl.float32)
    n2 = (x2 * rstd[:, None] * w2[None, :]).to(out_dtype).to(tl.float32)
    y1 = n1 * c1 - n2 * s1
    y2 = n2 * c2 + n1 * s2
    y_row = rows * (2 * half_dim)
    tl.store(y_ptr + y_row[:, None] + first[None, :], y1.to(out_dtype), mask=mask)
    tl.store(y_ptr + y_row[:, None] + second[None, :], y2.to(out_dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qy_ptr, ky_ptr,
    q_tiles, q_rows, k_rows, seq_len, q_heads, k_heads, half_dim, eps,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sc_b, sc_s, ss_b, ss_s,
    INTERLEAVED: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < q_tiles:
        _norm_and_rotate(
            q_ptr, qw_ptr, qy_ptr, cos_ptr, sin_ptr, pid, q_rows, q_heads, seq_len, half_dim, eps,
            sq_b, sq_s, sq_h, sc_b, sc_s, ss_b, ss_s, INTERLEAVED, ZERO_CENTERED, BLOCK_R, BLOCK_D,
        )  # fmt: skip
    else:
        _norm_and_rotate(
            k_ptr, kw_ptr, ky_ptr, cos_ptr, sin_ptr, pid - q_tiles, k_rows, k_heads, seq_len, half_dim,
            eps, sk_b, sk_s, sk_h, sc_b, sc_s, ss_b, ss_s, INTERLEAVED, ZERO_CENTERED, BLOCK_R, BLOCK_D,
        )  # fmt: skip


@dataclass(frozen=True)
class _Operands:
    """The operands as both launches read them (unit last strides), with their rows and tile."""

    query: torch.Tensor
    key: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_rows: int
    k_rows: int
    tile: int

    @property
    def strides(self) -> tuple[int, int, int, int, int, int, int, int, int, int]:
        """The kernels' ``sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sc_b, sc_s, ss_b, ss_s``."""
        q, k, c, s = self.query.stride(), self.key.stride(), self.cos.stride(), self.sin.stride()
        return q[0], q[1], q[2], k[0], k[1], k[2], c[0], c[1], s[0], s[1]

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """The kernels' ``seq_len, q_heads, k_heads, half_dim``."""
        _, seq, q_heads, head_dim = self.query.shape
        return seq, q_heads, self.key.shape[2], head_dim // 2

    def launch(self, interleaved: bool, zero_centered: bool) -> dict[str, Any]:
        block_d = next_power_of_2(self.sizes[3])
        return launch_options(
            INTERLEAVED=interleaved, ZERO_CENTERED=zero_centered, BLOCK_R=self.tile, BLOCK_D=block_d,
            num_warps=8 if self.tile * block_d >= 2048 else 4,
        )  # fmt: skip

    def empty_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous tensors shaped as the query and the key."""
        return (
            torch.empty_like(self.query, memory_format=torch.contiguous_format),
            torch.empty_like(self.key, memory_format=torch.contiguous_format),
        )


def _operands(
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows_per_tile: int | None,
) -> _Operands:
    batch, seq, q_heads, _ = query.shape
    q_rows, k_rows = batch * seq * q_heads, batch * seq * key.shape[2]
    return _Operands(
        unit_last_stride(query), unit_last_stride(key), q_weight.contiguous(), k_weight.contiguous(),
        unit_last_stride(cos), unit_last_stride(sin), q_rows, k_rows,
        rows_per_tile if rows_per_tile is not None else min(next_power_of_2(max(q_rows, 1)), _TILE_ROWS),
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
    *,
    rows_per_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalizes and rotates ``query`` and ``key`` (shapes checked by the public op).

    ``rows_per_tile`` (a power of two) overrides the tile's head rows, for tests and benchmarks.
    """
    ops = _operands(query, key, q_weight, k_weight, cos, sin, rows_per_tile)
    q_out, k_out = ops.empty_outputs()
    if ops.q_rows == 0:
        return q_out, k_out
    q_tiles = triton.cdiv(ops.q_rows, ops.tile)
    _qk_norm_rope_kernel[(q_tiles + triton.cdiv(ops.k_rows, ops.tile),)](
        ops.query, ops.key, ops.q_weight, ops.k_weight, ops.cos, ops.sin, q_out, k_out,
        q_tiles, ops.q_rows, ops.k_rows, *ops.sizes, eps, *ops.strides,
        **ops.launch(interleaved, zero_centered),
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def _tiles_backward(
    g_ptr, x_ptr, w_ptr, dx_ptr, cos_ptr, sin_ptr, partial_ptr, partial_row, first_tile, programs,
    steps, n_rows, n_heads, seq_len, half_dim, eps, sg_b, sg_s, sg_h, sx_b, sx_s, sx_h, sc_b, sc_s,
    ss_b, ss_s, INTERLEAVED: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program's tiles of one tensor (every ``programs``-th from ``first_tile``): writes dx and
    stores the program's partial sum of the weight's gradient at ``partial_row``."""
    # summed over the tile's rows once, after the last tile: no cross-warp reduction a step
    dw1 = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half_dim
    if INTERLEAVED:
        w_first, w_second = 2 * d, 2 * d + 1
    else:
        w_first, w_second = d, d + half_dim
    w1, w2 = _weight_halves(w_ptr, w_first, w_second, d_mask, ZERO_CENTERED)  # the same every tile
    for step in range(steps):
        rows, b, s, head, first, second, _, mask, c1, c2, s1, s2 = _tile(
            cos_ptr, sin_ptr, first_tile + step * programs, n_rows, n_heads, seq_len, half_dim,
            sc_b, sc_s, ss_b, ss_s, INTERLEAVED, BLOCK_R, BLOCK_D,
        )  # fmt: skip
        x_row = b * sx_b + s * sx_s + head * sx_h
        g_row = b * sg_b + s * sg_s + head * sg_h
        x1 = tl.load(x_ptr + x_row[:, None] + first[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_row[:, None] + second[None, :], mask=mask, other=0.0).to(tl.float32)
        g1 = tl.load(g_ptr + g_row[:, None] + first[None, :], mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(g_ptr + g_row[:, None] + second[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half_dim) + eps)
        # the rotation's transpose: y1 = n1 c1 - n2 s1, y2 = n2 c2 + n1 s2
        dn1 = g1 * c1 + g2 * s2
        dn2 = g2 * c2 - g1 * s1
        xhat1 = x1 * rstd[:, None]
        xhat2 = x2 * rstd[:, None]
        dxhat1 = dn1 * w1[None, :]
        dxhat2 = dn2 * w2[None, :]
        mean = (tl.sum(dxhat1 * xhat1, axis=1) + tl.sum(dxhat2 * xhat2, axis=1)) / (2 * half_dim)
        dx1 = rstd[:, None] * (dxhat1 - xhat1 * mean[:, None])
        dx2 = rstd[:, None] * (dxhat2 - xhat2 * mean[:, None])
        dx_row = rows * (2 * half_dim)
        out_dtype = dx_ptr.dtype.element_ty
        tl.store(dx_ptr + dx_row[:, None] + first[None, :], dx1.to(out_dtype), mask=mask)
        tl.store(dx_ptr + dx_row[:, None] + second[None, :], dx2.to(out_dtype), mask=mask)
        dw1 += dn1 * xhat1  # masked rows load zeros: their xhat is zero
        dw2 += dn2 * xhat2
    row = partial_row.to(tl.int64) * (2 * half_dim)
    tl.store(partial_ptr + row + w_first, tl.sum(dw1, axis=0), mask=d_mask)
    tl.store(partial_ptr + row + w_second, tl.sum(dw2, axis=0), mask=d_mask)


@triton.jit
def _qk_norm_rope_backward_kernel(
    gq_ptr, gk_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, dq_ptr, dk_ptr, partial_ptr,
    q_rows, k_rows, q_steps, k_steps, seq_len, q_heads, k_heads, half_dim, eps,
    sgq_b, sgq_s, sgq_h, sgk_b, sgk_s, sgk_h, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sc_b, sc_s, ss_b, ss_s,
    INTERLEAVED: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Persistent programs, each over its share of the query tiles, then of the key tiles;
    ``partial_ptr`` is ``(2, programs, head_dim)`` fp32, a partial row of each weight's gradient a
    program."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    _tiles_backward(
        gq_ptr, q_ptr, qw_ptr, dq_ptr, cos_ptr, sin_ptr, partial_ptr, pid, pid, programs, q_steps,
        q_rows, q_heads, seq_len, half_dim, eps, sgq_b, sgq_s, sgq_h, sq_b, sq_s, sq_h, sc_b, sc_s,
        ss_b, ss_s, INTERLEAVED, ZERO_CENTERED, BLOCK_R, BLOCK_D,
    )  # fmt: skip
    _tiles_backward(
        gk_ptr, k_ptr, kw_ptr, dk_ptr, cos_ptr, sin_ptr, partial_ptr, programs + pid, pid, programs,
        k_steps, k_rows, k_heads, seq_len, half_dim, eps, sgk_b, sgk_s, sgk_h, sk_b, sk_s, sk_h,
        sc_b, sc_s, ss_b, ss_s, INTERLEAVED, ZERO_CENTERED, BLOCK_R, BLOCK_D,
    )  # fmt: skip


def qk_norm_rope_backward(
    grad_query: torch.Tensor,
    grad_key: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    zero_centered: bool,
    interleaved: bool,
    *,
    programs_per_sm: int | None = None,
    rows_per_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(d query, d key, d q_weight, d k_weight)`` of ``qk_norm_rope_kernel``'s outputs.

    The norms' statistics are recomputed from the inputs; the weights' gradients are summed from
    per-program fp32 partials in a fixed order. The gradient treats each norm's rounding to the
    output dtype as the identity, as the separate ops' backward does. ``programs_per_sm``
    (``backward_programs_per_sm``'s by default) and ``rows_per_tile`` override the launch, for tests
    and benchmarks.
    """
    grad_query, grad_key = unit_last_stride(grad_query), unit_last_stride(grad_key)
    ops = _operands(query, key, q_weight, k_weight, cos, sin, rows_per_tile)
    dq, dk = ops.empty_outputs()
    if ops.q_rows == 0:
        return dq, dk, torch.zeros_like(q_weight), torch.zeros_like(k_weight)
    q_tiles, k_tiles = triton.cdiv(ops.q_rows, ops.tile), triton.cdiv(ops.k_rows, ops.tile)
    per_sm = programs_per_sm if programs_per_sm is not None else backward_programs_per_sm(query.shape[3])
    programs = min(q_tiles, multiprocessor_count(query.device) * per_sm)
    partials = torch.empty((2, programs, query.shape[3]), dtype=torch.float32, device=query.device)
    _qk_norm_rope_backward_kernel[(programs,)](
        grad_query, grad_key, ops.query, ops.key, ops.q_weight, ops.k_weight, ops.cos, ops.sin, dq, dk,
        partials, ops.q_rows, ops.k_rows, triton.cdiv(q_tiles, programs), triton.cdiv(k_tiles, programs),
        *ops.sizes, eps,
        grad_query.stride(0), grad_query.stride(1), grad_query.stride(2),
        grad_key.stride(0), grad_key.stride(1), grad_key.stride(2), *ops.strides,
        **ops.launch(interleaved, zero_centered),
    )  # fmt: skip
    dq_weight, dk_weight = sum_partials(partials, (q_weight.dtype, k_weight.dtype))
    return dq, dk, dq_weight, dk_weight
