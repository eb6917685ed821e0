# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""Stochastic rounding to bf16 and the fused AdamW step, as Triton kernels.

Random bits come from Triton's Philox generator keyed by (seed, element index), so a given seed
gives the same rounding wherever the kernel runs.
"""

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import launch_options

_BLOCK = 2048


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
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    n,
    lr,
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
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p = p * decay_factor
    m = m * beta1 + g * (1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    p = p - step_size * m / (tl.sqrt(v) * inv_bias_correction2_sqrt + eps)
    r0, r1, r2, _ = tl.randint4x(seed, offsets.to(tl.int32))
    if PARAM_BF16:
        tl.store(param_ptr + offsets, _round_bf16(p, r0), mask=mask)
    else:
        tl.store(param_ptr + offsets, p, mask=mask)
    if EXP_AVG_BF16:
        tl.store(exp_avg_ptr + offsets, _round_bf16(m, r1), mask=mask)
    else:
        tl.store(exp_avg_ptr + offsets, m, mask=mask)
    if EXP_AVG_SQ_BF16:
        tl.store(exp_avg_sq_ptr + offsets, _round_bf16(v, r2), mask=mask)
    else:
        tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)


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
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        n,
        lr,
        beta1,
        beta2,
        eps,
        1.0 - lr * weight_decay,
        lr / bias_correction1,
        1.0 / bias_correction2_sqrt,
        seed,
        **launch_options(
            PARAM_BF16=param.dtype == torch.bfloat16,
            EXP_AVG_BF16=exp_avg.dtype == torch.bfloat16,
            EXP_AVG_SQ_BF16=exp_avg_sq.dtype == torch.bfloat16,
            BLOCK=_BLOCK,
            num_warps=8,
        ),
    )
