# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""Flash-decoding over a paged key/value pool: split programs, then a combine.

One program per (row, kv head, split) loads the query heads of its GQA group (padded to 16 rows for
``tl.dot``), walks its share of the row's visible positions ``BLOCK_N`` at a time, looking each
position's slot up in the block table, and keeps an online softmax in fp32 (base 2). With one split
it finishes the row itself (sinks, normalization, cast); with several it writes an unnormalized
partial ``(acc, max, sum)`` and a combine program per (row, query head) merges the splits by their
maxima and adds the sink to the denominator. A row's visible span is divided among the splits in the
kernel, from its length on the device, so no host ever reads a length.

Programs start row by row, in ``row_order`` where given: longest rows first, the short rows' programs
fill the SMs at the end instead of a long row's programs running on alone.

With a write (``new_key``, ``new_value``, ``write_slots``: a decode step's new token, at position
``length - 1``), the programs walk the pool up to that position only; the one whose span holds it adds
the new key and value from the inputs as one more softmax column, and the first split of each
(row, kv head) stores them into the pool. No program depends on another's store, no tile pays for a
per-position select, and the decode step needs no separate ``index_copy_`` launches.

With a prologue (``qk_norm_rope``: Qwen3's per-head norms, then the rotation), the query heads and the
new key arrive as projected: each program normalizes and rotates what it loads, rounding the norm and
the result to the input dtype as ``qk_norm_rope`` does, so the pool stores and the softmax sees what
the separate launch would have given.
"""

import torch
import triton
import triton.language as tl

from d9d.kernels._paged_attention_inputs import PagedDecodeInputs
from d9d.kernels._triton.launch import interpreted, launch_options, next_power_of_2, unit_last_stride

_LOG2E = 1.4426950408889634
LOG2E = tl.constexpr(_LOG2E)
_MAX_GRID_ROWS = 65535  # CUDA's limit on a grid's z dimension, where the rows are


@triton.jit
def _finish(acc, m_i, l_i, sink, length):
    """Normalizes an (H, DV) accumulator with its max and sum (base 2) and a sink logit (base 2)."""
    big = tl.maximum(m_i, sink)
    big = tl.where(big == float("-inf"), 0.0, big)
    scale = tl.exp2(m_i - big)
    denom = l_i * scale + tl.exp2(sink - big)
    denom = tl.where(denom == 0.0, 1.0, denom)
    out = acc * (scale / denom)[:, None]
    return tl.where(length > 0, out, 0.0)


@triton.jit
def _sink_logits(sinks_ptr, heads, h_mask, HAS_SINKS: tl.constexpr):
    """The heads' sink logits in base 2, or -inf (a column that takes no weight) without sinks."""
    sink = tl.full(heads.shape, float("-inf"), tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * LOG2E
    return sink


@triton.jit
def _rotation_partners(d, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Each element's partner in its rotation plane and the sign of its sine term:
    ``y[d] = x[d] * cos[d] + sign[d] * x[partner[d]] * sin[d]``."""
    if INTERLEAVED:
        odd = d % 2
        partner = d + 1 - 2 * odd
        sign = tl.where(odd == 0, -1.0, 1.0)
    else:
        first = d < HEAD_DIM // 2
        partner = tl.where(first, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
        sign = tl.where(first, -1.0, 1.0)
    return partner, sign


@triton.jit
def _normalized_rotated(
    x_ptrs, partner_ptrs, mask, w_ptr, cos, sin, d, partner, sign, d_mask, eps,
    HEAD_DIM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):  # fmt: skip
    """RMSNorm over the last axis of the ``(heads, BLOCK_D)`` tile at ``x_ptrs``, then the rotation
    (``partner_ptrs``: the same tile at the partners' offsets); the norm rounded to the input dtype
    before the rotation, the result in the input dtype."""
    dtype = x_ptrs.dtype.element_ty
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    w_partner = tl.load(w_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
        w_partner = w_partner + 1.0
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
    normed = (x * rstd[:, None] * w[None, :]).to(dtype).to(tl.float32)
    normed_partner = (x_partner * rstd[:, None] * w_partner[None, :]).to(dtype).to(tl.float32)
    return (normed * cos[None, :] + sign[None, :] * normed_partner * sin[None, :]).to(dtype)


@triton.jit
def _attend_block(
    q, m_i, l_i, acc, k_base, v_base, table_row, n0, end, d, dv, d_mask, dv_mask, sk_s, sk_d, sv_s, sv_d,
    qk_scale, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over positions ``n0 .. n0 + BLOCK_N`` (those below ``end``)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    block = tl.load(table_row + pos // PAGE_SIZE, mask=valid, other=0)
    slot = block.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
    # keys loaded transposed, (head_dim, positions), for q @ k; values (positions, value_dim)
    k = tl.load(
        k_base + slot[None, :] * sk_s + d[:, None] * sk_d, mask=valid[None, :] & d_mask[:, None], other=0.0
    )
    v = tl.load(
        v_base + slot[:, None] * sv_s + dv[None, :] * sv_d, mask=valid[:, None] & dv_mask[None, :], other=0.0
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, sinks_ptr, out_ptr, part_ptr, max_ptr, sum_ptr,
    new_k_ptr, new_v_ptr, write_ptr, order_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
    q_heads, group, window, qk_scale, eps,
    sq_r, sq_h, sq_d, sk_s, sk_h, sk_d, sv_s, sv_h, sv_d, st_r, so_r, so_h, snk_r, snk_h, snv_r, snv_h,
    sc_r, ss_r,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WRITE: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_PROLOGUE: tl.constexpr,
    INTERLEAVED: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):  # fmt: skip
    # the kv heads vary fastest in the launch order: the programs running together read neighbouring
    # bytes of the same slots (5-7% faster at 64 rollout rows than rows fastest, 4% at 256); then the
    # splits, then the rows
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    if HAS_ORDER:
        row = tl.load(order_ptr + row)
    length = tl.load(lengths_ptr + row)
    low = 0
    if HAS_WINDOW:
        low = tl.maximum(length - window, 0)
    chunk = tl.cdiv(tl.cdiv(length - low, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = low + split * chunk
    end = tl.minimum(start + chunk, length)

    h = tl.arange(0, BLOCK_H)
    heads = kv_head * group + h
    h_mask = h < group
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_mask = d < HEAD_DIM
    dv_mask = dv < VALUE_DIM
    q_heads_ptr = q_ptr + row.to(tl.int64) * sq_r + heads[:, None] * sq_h
    q_mask = h_mask[:, None] & d_mask[None, :]
    if HAS_PROLOGUE:
        partner, sign = _rotation_partners(d, HEAD_DIM, INTERLEAVED)
        cos = tl.load(cos_ptr + row.to(tl.int64) * sc_r + d, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row.to(tl.int64) * ss_r + d, mask=d_mask, other=0.0).to(tl.float32)
        q = _normalized_rotated(
            q_heads_ptr + d[None, :] * sq_d, q_heads_ptr + partner[None, :] * sq_d, q_mask, qw_ptr, cos, sin,
            d, partner, sign, d_mask, eps, HEAD_DIM, ZERO_CENTERED,
        )  # fmt: skip
    else:
        q = tl.load(q_heads_ptr + d[None, :] * sq_d, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + kv_head.to(tl.int64) * sk_h
    v_base = v_ptr + kv_head.to(tl.int64) * sv_h
    table_row = table_ptr + row.to(tl.int64) * st_r
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    pool_end = end
    if HAS_WRITE:  # the new position's slot may still be stale: it comes from the inputs below
        pool_end = tl.minimum(end, length - 1)
    for n0 in range(start, pool_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, k_base, v_base, table_row, n0, pool_end, d, dv, d_mask, dv_mask, sk_s, sk_d,
            sv_s, sv_d, qk_scale, PAGE_SIZE, BLOCK_N, UPCAST, PRECISION,
        )  # fmt: skip
    if HAS_WRITE:
        # the new position as one more column, in the split whose span holds it; then the first
        # split stores the new key and value (the other splits' masks are empty)
        write_slot = tl.load(write_ptr + row).to(tl.int64)
        new_k_head = new_k_ptr + row.to(tl.int64) * snk_r + kv_head * snk_h
        if HAS_PROLOGUE:
            new_k = _normalized_rotated(
                new_k_head + d[None, :], new_k_head + partner[None, :], d_mask[None, :], kw_ptr, cos, sin,
                d, partner, sign, d_mask, eps, HEAD_DIM, ZERO_CENTERED,
            )  # fmt: skip
            new_k = tl.reshape(new_k, (BLOCK_D,))
        else:
            new_k = tl.load(new_k_head + d, mask=d_mask, other=0.0)
        new_v = tl.load(new_v_ptr + row.to(tl.int64) * snv_r + kv_head * snv_h + dv, mask=dv_mask, other=0.0)
        holds_new = (length - 1 >= start) & (length - 1 < end)
        score = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], axis=1) * qk_scale
        score = tl.where(holds_new, score, float("-inf"))
        m_new = tl.maximum(m_i, score)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p_new = tl.exp2(score - m_safe)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * new_v.to(tl.float32)[None, :]
        m_i = m_new
        k_first = d_mask & (d * 0 + split == 0)
        v_first = dv_mask & (dv * 0 + split == 0)
        tl.store(k_base + write_slot * sk_s + d * sk_d, new_k, mask=k_first)
        tl.store(v_base + write_slot * sv_s + dv * sv_d, new_v, mask=v_first)
    if NUM_SPLITS == 1:
        out = _finish(acc, m_i, l_i, _sink_logits(sinks_ptr, heads, h_mask, HAS_SINKS), length)
        tl.store(
            out_ptr + row.to(tl.int64) * so_r + heads[:, None] * so_h + dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & dv_mask[None, :],
        )
    else:
        stat = (row.to(tl.int64) * q_heads + heads) * NUM_SPLITS + split
        tl.store(max_ptr + stat, m_i, mask=h_mask)
        tl.store(sum_ptr + stat, l_i, mask=h_mask)
        tl.store(
            part_ptr + stat[:, None] * VALUE_DIM + dv[None, :], acc, mask=h_mask[:, None] & dv_mask[None, :]
        )


@triton.jit
def _paged_decode_combine_kernel(
    part_ptr, max_ptr, sum_ptr, lengths_ptr, sinks_ptr, out_ptr,
    q_heads, so_r, so_h,
    VALUE_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(lengths_ptr + row)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < NUM_SPLITS
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < VALUE_DIM
    stat = (row.to(tl.int64) * q_heads + head) * NUM_SPLITS + s
    m_s = tl.load(max_ptr + stat, mask=s_mask, other=float("-inf"))
    l_s = tl.load(sum_ptr + stat, mask=s_mask, other=0.0)
    acc_s = tl.load(
        part_ptr + stat[:, None] * VALUE_DIM + dv[None, :], mask=s_mask[:, None] & dv_mask[None, :], other=0.0
    )
    # keep a leading axis of one "head" so that _finish sees the split kernel's shapes
    m = tl.max(m_s, axis=0)
    weight = tl.exp2(m_s - tl.where(m == float("-inf"), 0.0, m))
    acc = tl.sum(acc_s * weight[:, None], axis=0, keep_dims=True)
    total = tl.sum(l_s[None, :] * weight[None, :], axis=1)
    m = tl.max(m_s[None, :], axis=1)
    heads = head + tl.zeros((1,), tl.int32)
    out = _finish(acc, m, total, _sink_logits(sinks_ptr, heads, heads >= 0, HAS_SINKS), length)
    tl.store(
        out_ptr + row.to(tl.int64) * so_r + head * so_h + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=dv_mask[None, :],
    )


def _precision(x: torch.Tensor) -> str:
    # fp32 inputs get full fp32 products (tl.dot would otherwise use TF32 on the GPU).
    return "ieee" if x.dtype == torch.float32 or interpreted() else "tf32"


def paged_decode_attention_kernel(
    inputs: PagedDecodeInputs,
    num_splits: int,
    block_n: int,
    *,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Launches the split kernel (and, for ``num_splits > 1``, the combine kernel); see the module.

    ``num_warps`` and ``num_stages`` are the split kernel's launch shape (the benchmark sweeps them).
    """
    query, key_cache, value_cache = inputs.query, inputs.key_cache, inputs.value_cache
    block_table, lengths, sinks = inputs.block_table, inputs.lengths, inputs.sinks
    page_size, sliding_window = inputs.page_size, inputs.sliding_window
    rows, q_heads, head_dim, kv_heads = inputs.rows, inputs.q_heads, inputs.head_dim, inputs.kv_heads
    value_dim, group = inputs.value_dim, inputs.group
    if rows > _MAX_GRID_ROWS:
        raise ValueError(
            f"paged_decode_attention: {rows} rows exceed the Triton kernel's {_MAX_GRID_ROWS} (its launch "
            "grid's last dimension); split the batch"
        )
    out = torch.empty((rows, q_heads, value_dim), dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    # the partials exist only with several splits (one split finishes its rows in place)
    stats = (rows, q_heads, num_splits) if num_splits > 1 else (0,)
    partial = torch.empty((*stats, value_dim), dtype=torch.float32, device=query.device)
    maxima = torch.empty(stats, dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxima)
    sink_arg = sinks if sinks is not None else maxima
    block_dv = next_power_of_2(value_dim)
    # without a write the new-token arguments are never read: any tensor of the right kind stands in
    new_key = query if inputs.new_key is None else unit_last_stride(inputs.new_key)
    new_value = query if inputs.new_value is None else unit_last_stride(inputs.new_value)
    write_slots = lengths if inputs.write_slots is None else inputs.write_slots
    row_order = lengths if inputs.row_order is None else inputs.row_order
    prologue = inputs.qk_norm_rope
    # without a prologue its weights and tables are never read either
    q_weight, k_weight = (query, query) if prologue is None else (prologue.q_weight, prologue.k_weight)
    cos, sin = (
        (query, query)
        if prologue is None
        else (unit_last_stride(prologue.cos), unit_last_stride(prologue.sin))
    )
    _paged_decode_split_kernel[(kv_heads, num_splits, rows)](
        query, key_cache, value_cache, block_table, lengths, sink_arg, out, partial, maxima, sums,
        new_key, new_value, write_slots, row_order, q_weight.contiguous(), k_weight.contiguous(), cos, sin,
        q_heads, group, sliding_window or 0, inputs.softmax_scale * _LOG2E,
        prologue.eps if prologue is not None else 0.0,
        query.stride(0), query.stride(1), query.stride(2), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        new_key.stride(0), new_key.stride(1), new_value.stride(0), new_value.stride(1),
        cos.stride(0), sin.stride(0),
        **launch_options(
            HEAD_DIM=head_dim, VALUE_DIM=value_dim, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
            HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
            BLOCK_H=max(16, next_power_of_2(group)), BLOCK_N=block_n,
            BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_DV=max(16, block_dv),
            UPCAST=interpreted(), PRECISION=_precision(query), HAS_WRITE=inputs.writes,
            HAS_ORDER=inputs.row_order is not None, HAS_PROLOGUE=prologue is not None,
            INTERLEAVED=prologue is not None and prologue.layout == "interleaved",
            ZERO_CENTERED=prologue is not None and prologue.zero_centered_weight,
            num_warps=num_warps, num_stages=num_stages,
        ),
    )  # fmt: skip
    if num_splits > 1:
        _paged_decode_combine_kernel[(rows, q_heads)](
            partial, maxima, sums, lengths, sink_arg, out, q_heads, out.stride(0), out.stride(1),
            **launch_options(
                VALUE_DIM=value_dim, NUM_SPLITS=num_splits, HAS_SINKS=sinks is not None,
                BLOCK_S=next_power_of_2(num_splits), BLOCK_DV=block_dv, num_warps=4 if block_dv >= 256 else 2,
            ),
        )  # fmt: skip
    return out
