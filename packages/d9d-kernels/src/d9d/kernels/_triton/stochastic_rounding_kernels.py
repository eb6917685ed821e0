# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""Stochastic rounding to bf16 and the fused AdamW step, as Triton kernels.

Random bits come from Triton's Philox generator keyed by (seed, element index), so a given seed
gives the same rounding wherever the kernel runs. The AdamW step draws one Philox call per pair of
elements: each rounding needs only 16 bits, so a call's four 32-bit outputs hold the pair's three
(parameter, first and second moment); with bf16 moments one call per element made the kernel
bound by the generator rather than by memory. The pairs are elements ``_PAIR_SPAN`` apart
(element ``e`` and ``e + _PAIR_SPAN`` in each span of ``2 * _PAIR_SPAN``), so a block is a
(spans, 2, _PAIR_SPAN) tile whose halves take the low and high 16 bits by broadcasting, with no
reshuffling of registers; the pairing depends only on the element index, not on the block size.
"""

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import launch_options

_BLOCK = 2048
# The multi-tensor kernel's programs each update up to _MULTI_BLOCKS_PER_PROGRAM blocks of one
# tensor. Measured on an H200 (bf16 state, Qwen3-0.6B and Qwen3-30B-A3B parameter lists, block
# 1024 to 4096, 1 to 32 blocks, 4 or 8 warps): short programs of small blocks keep the most loads in
# flight; 32 blocks of 2048 per program took 1.3x to 1.5x as long as 2 of 1024. One block of 1024,
# 1.00x-0.93x of 2 alone (benchmarks/bench_adamw_launch.py), took 1.15x inside a training step of
# the MoE benchmark model (23.9 against 20.9 ms).
_MULTI_BLOCK = 1024
_MULTI_BLOCKS_PER_PROGRAM = 2
_MULTI_NUM_WARPS = 4
# Elements paired on one random draw are this far apart; blocks are multiples of twice it.
_PAIR_SPAN_ELEMENTS = 512
_PAIR_SPAN: tl.constexpr = tl.constexpr(_PAIR_SPAN_ELEMENTS)
# Columns of the multi-tensor table: where param, grad, exp_avg and exp_avg_sq start (in elements
# from the first tensor of their list), numel, seed.
_TABLE_COLUMNS: tl.constexpr = tl.constexpr(6)
_MASKED: tl.constexpr = tl.constexpr(True)
_UNMASKED: tl.constexpr = tl.constexpr(False)


@triton.jit
def _round_bf16(x, random_bits):
    # Adds 16 random bits below the bf16 mantissa and truncates them: rounds up in magnitude with
    # probability equal to the truncated fraction. NaN and infinity are kept as they are.
    bits = x.to(tl.int32, bitcast=True)
    noise = (random_bits & 0xFFFF).to(tl.int32)
    rounded = ((bits + noise) & -65536).to(tl.float32, bitcast=True)
    finite = tl.abs(x) < float("inf")
    return tl.where(finite, rounded, x).to(tl.bfloat16)


@triton.jit
def _copy_stochastic_kernel(src_ptr, dst_ptr, n, seed, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(src_ptr + offsets, mask=mask, other=0.0)
    random_bits = tl.randint(seed, offsets.to(tl.int32))
    tl.store(dst_ptr + offsets, _round_bf16(x, random_bits), mask=mask)


@triton.jit
def _load_fp32(pointers, mask, MASKED: tl.constexpr):
    # Unmasked loads and stores of aligned, contiguous blocks compile to vector instructions; a mask
    # on a bound of unknown divisibility (a size read from memory) forces one element per access.
    if MASKED:
        return tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.load(pointers).to(tl.float32)


@triton.jit
def _store_rounded(pointers, x, random_bits, mask, BF16: tl.constexpr, MASKED: tl.constexpr):
    value = _round_bf16(x, random_bits) if BF16 else x
    if MASKED:
        tl.store(pointers, value, mask=mask)
    else:
        tl.store(pointers, value)


@triton.jit
def _adamw_update(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    start,
    n,
    seed,
    grad_scale,
    beta1,
    beta2,
    eps,
    decay_factor,
    step_size,
    inv_bias_correction2_sqrt,
    PARAM_BF16: tl.constexpr,
    EXP_AVG_BF16: tl.constexpr,
    EXP_AVG_SQ_BF16: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The elements [start, start + BLOCK) as a (spans, 2, _PAIR_SPAN) tile; start is a multiple of
    # BLOCK, itself a multiple of 2 * _PAIR_SPAN. Element (k, h, j) draws Philox call (k, j) and
    # takes its low 16 bits in half h = 0, its high 16 bits in half h = 1.
    span = tl.arange(0, BLOCK // (2 * _PAIR_SPAN))[:, None, None]
    half = tl.arange(0, 2)[None, :, None]
    column = tl.arange(0, _PAIR_SPAN)[None, None, :]
    offsets = start + span * (2 * _PAIR_SPAN) + half * _PAIR_SPAN + column
    mask = offsets < n
    p = _load_fp32(param_ptr + offsets, mask, MASKED)
    g = _load_fp32(grad_ptr + offsets, mask, MASKED) * grad_scale
    m = _load_fp32(exp_avg_ptr + offsets, mask, MASKED)
    v = _load_fp32(exp_avg_sq_ptr + offsets, mask, MASKED)
    p = p * decay_factor
    m = m * beta1 + g * (1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    p = p - step_size * m / (tl.sqrt(v) * inv_bias_correction2_sqrt + eps)
    draws = (start // 2 + span * _PAIR_SPAN + column).to(tl.int32)
    r0, r1, r2, _ = tl.randint4x(seed, draws)
    high = half == 1
    _store_rounded(param_ptr + offsets, p, _half_of(r0, high), mask, PARAM_BF16, MASKED)
    _store_rounded(exp_avg_ptr + offsets, m, _half_of(r1, high), mask, EXP_AVG_BF16, MASKED)
    _store_rounded(exp_avg_sq_ptr + offsets, v, _half_of(r2, high), mask, EXP_AVG_SQ_BF16, MASKED)


@triton.jit
def _half_of(bits, high):
    # 16 of a draw's 32 bits: the high ones where ``high``, else the low ones (broadcast).
    return tl.where(high, (bits >> 16) & 0xFFFF, bits & 0xFFFF)


@triton.jit
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    n,
    beta1,
    beta2,
    eps,
    decay_factor,
    step_size,
    inv_bias_correction2_sqrt,
    seed,
    PARAM_BF16: tl.constexpr,
    EXP_AVG_BF16: tl.constexpr,
    EXP_AVG_SQ_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    _adamw_update(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, tl.program_id(0).to(tl.int64) * BLOCK, n,
        seed, 1.0, beta1, beta2, eps, decay_factor, step_size, inv_bias_correction2_sqrt,
        PARAM_BF16, EXP_AVG_BF16, EXP_AVG_SQ_BF16, _MASKED, BLOCK,
    )  # fmt: skip


@triton.jit
def _member(base_ptr, offset, ALIGN: tl.constexpr):
    # A tensor of the list as an element offset from the list's first tensor: the base pointer is a
    # kernel argument, so the compiler knows its alignment, and the hint covers the offset; both
    # let it vectorise the loads and stores as for a tensor argument.
    if ALIGN > 1:
        offset = tl.multiple_of(offset, ALIGN)
    return base_ptr + offset


@triton.jit
def _adamw_multi_kernel(
    table_ptr,
    chunk_starts_ptr,
    param_base,
    grad_base,
    exp_avg_base,
    exp_avg_sq_base,
    grad_scale_ptr,
    n_tensors,
    beta1,
    beta2,
    eps,
    decay_factor,
    step_size,
    inv_bias_correction2_sqrt,
    PARAM_BF16: tl.constexpr,
    EXP_AVG_BF16: tl.constexpr,
    EXP_AVG_SQ_BF16: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    PARAM_ALIGN: tl.constexpr,
    GRAD_ALIGN: tl.constexpr,
    EXP_AVG_ALIGN: tl.constexpr,
    EXP_AVG_SQ_ALIGN: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
):
    # One program per chunk of BLOCKS_PER_PROGRAM blocks of one tensor (fewer, longer programs
    # spread the table lookups); a binary search over the tensors' first chunk indices finds the
    # tensor (invariant: chunk_starts[lo] <= pid < chunk_starts[hi]).
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0
    hi = lo + n_tensors
    for _ in tl.static_range(SEARCH_STEPS):  # pyright: ignore[reportGeneralTypeIssues]
        mid = (lo + hi) // 2
        right = tl.load(chunk_starts_ptr + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    row = table_ptr + lo * _TABLE_COLUMNS
    param_ptr = _member(param_base, tl.load(row), PARAM_ALIGN)
    grad_ptr = _member(grad_base, tl.load(row + 1), GRAD_ALIGN)
    exp_avg_ptr = _member(exp_avg_base, tl.load(row + 2), EXP_AVG_ALIGN)
    exp_avg_sq_ptr = _member(exp_avg_sq_base, tl.load(row + 3), EXP_AVG_SQ_ALIGN)
    n = tl.load(row + 4)
    seed = tl.load(row + 5).to(tl.int32)
    grad_scale = tl.load(grad_scale_ptr).to(tl.float32) if HAS_GRAD_SCALE else 1.0
    first = (pid - tl.load(chunk_starts_ptr + lo)) * (BLOCK * BLOCKS_PER_PROGRAM)
    # Whole blocks unmasked, then the tensor's partial last block (if this chunk holds it) masked.
    whole = tl.minimum((n - first) // BLOCK, BLOCKS_PER_PROGRAM)
    for block in range(whole):
        _adamw_update(
            param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, first + block * BLOCK, n, seed,
            grad_scale, beta1, beta2, eps, decay_factor, step_size, inv_bias_correction2_sqrt,
            PARAM_BF16, EXP_AVG_BF16, EXP_AVG_SQ_BF16, _UNMASKED, BLOCK,
        )  # fmt: skip
    tail = first + whole * BLOCK
    if (whole < BLOCKS_PER_PROGRAM) & (tail < n):
        _adamw_update(
            param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, tail, n, seed, grad_scale, beta1,
            beta2, eps, decay_factor, step_size, inv_bias_correction2_sqrt, PARAM_BF16, EXP_AVG_BF16,
            EXP_AVG_SQ_BF16, _MASKED, BLOCK,
        )  # fmt: skip


def copy_stochastic(target: torch.Tensor, source: torch.Tensor, seed: int) -> None:
    """Writes ``source`` (fp32, contiguous) into ``target`` (bf16, contiguous), rounding stochastically."""
    n = source.numel()
    if n > 0:
        _copy_stochastic_kernel[(triton.cdiv(n, _BLOCK),)](
            source, target, n, seed, **launch_options(BLOCK=_BLOCK, num_warps=8)
        )


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    seed: int,
) -> None:
    """One AdamW step over contiguous tensors, in place; bf16 ones are rounded stochastically."""
    n = param.numel()
    if n == 0:
        return
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        n,
        *_hyperparameters(lr, beta1, beta2, eps, weight_decay, step),
        seed,
        **launch_options(
            PARAM_BF16=param.dtype == torch.bfloat16,
            EXP_AVG_BF16=exp_avg.dtype == torch.bfloat16,
            EXP_AVG_SQ_BF16=exp_avg_sq.dtype == torch.bfloat16,
            BLOCK=_BLOCK,
            num_warps=8,
        ),
    )


def _hyperparameters(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int
) -> tuple[float, float, float, float, float, float]:
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    return beta1, beta2, eps, 1.0 - lr * weight_decay, lr / bias_correction1, 1.0 / bias_correction2_sqrt


def _element_offsets(tensors: list[torch.Tensor], anchor: int) -> list[int]:
    base = tensors[anchor].data_ptr()
    size = tensors[anchor].element_size()
    distances = [t.data_ptr() - base for t in tensors]
    if any(distance % size for distance, t in zip(distances, tensors, strict=True) if t.numel()):
        raise ValueError("adamw_step_stochastic_multi_: a tensor is not aligned to its element size")
    return [distance // size for distance in distances]


def _alignment(tensors: list[torch.Tensor]) -> int:
    """Elements per 16 bytes when every non-empty tensor starts on a 16-byte boundary, else 1."""
    aligned = all(t.data_ptr() % 16 == 0 for t in tensors if t.numel())
    return 16 // tensors[0].element_size() if aligned else 1


def adamw_step_multi(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    seeds: list[int],
    grad_scale: torch.Tensor | None = None,
    *,
    block: int = _MULTI_BLOCK,
    blocks_per_program: int = _MULTI_BLOCKS_PER_PROGRAM,
    num_warps: int = _MULTI_NUM_WARPS,
) -> None:
    """One AdamW step over many contiguous tensors in one launch; each list shares one dtype.

    The kernel reads the tensors' positions, sizes and seeds from a small table copied to the
    device (pinned, asynchronous: no wait for the stream), so the host cost is one launch however
    many parameters there are. Tensor ``i`` gets the same result as ``adamw_step`` with ``seeds[i]``
    (and the fp32 gradient ``grad_scale * grads[i]`` when a float32 device scalar is given).
    """
    if block % (2 * _PAIR_SPAN_ELEMENTS) != 0:
        raise ValueError(f"adamw_step_multi: block {block} must be a multiple of {2 * _PAIR_SPAN_ELEMENTS}")
    sizes = [t.numel() for t in params]
    if not any(sizes):
        return
    # Positions count from the first non-empty tensor (an empty one may have no storage).
    anchor = next(index for index, size in enumerate(sizes) if size)
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    offsets = [_element_offsets(tensors, anchor) for tensors in lists]
    rows: list[int] = []
    chunk_starts = [0]
    for *member_offsets, size, seed in zip(*offsets, sizes, seeds, strict=True):
        rows += [*member_offsets, size, seed]
        chunk_starts.append(chunk_starts[-1] + triton.cdiv(size, block * blocks_per_program))
    n_chunks = chunk_starts[-1]
    device = params[anchor].device
    host = torch.tensor(rows + chunk_starts, dtype=torch.int64)
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    _adamw_multi_kernel[(n_chunks,)](
        table,
        table[len(rows) :],
        params[anchor],
        grads[anchor],
        exp_avgs[anchor],
        exp_avg_sqs[anchor],
        table if grad_scale is None else grad_scale,  # the table: a placeholder, never read
        len(params),
        *_hyperparameters(lr, beta1, beta2, eps, weight_decay, step),
        **launch_options(
            PARAM_BF16=params[0].dtype == torch.bfloat16,
            EXP_AVG_BF16=exp_avgs[0].dtype == torch.bfloat16,
            EXP_AVG_SQ_BF16=exp_avg_sqs[0].dtype == torch.bfloat16,
            HAS_GRAD_SCALE=grad_scale is not None,
            PARAM_ALIGN=_alignment(params),
            GRAD_ALIGN=_alignment(grads),
            EXP_AVG_ALIGN=_alignment(exp_avgs),
            EXP_AVG_SQ_ALIGN=_alignment(exp_avg_sqs),
            SEARCH_STEPS=len(params).bit_length(),
            BLOCK=block,
            BLOCKS_PER_PROGRAM=blocks_per_program,
            num_warps=num_warps,
        ),
    )
