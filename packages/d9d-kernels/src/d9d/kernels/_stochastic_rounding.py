"""Stochastic rounding to bf16 and the fused AdamW step: the public ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._reference.stochastic_rounding import (
    adamw_step_reference,
    stochastic_round_to_bf16_reference,
)

_SEED_BOUND = 2**31 - 1


def _resolve_seed(seed: int | None) -> int:
    # Drawn from torch's CPU default generator: reproducible under torch.manual_seed, no device sync.
    return int(torch.randint(0, _SEED_BOUND, ())) if seed is None else seed % _SEED_BOUND


def draw_seeds(count: int) -> list[int]:
    """``count`` rounding seeds from torch's CPU default generator, as the multi-tensor step draws them."""
    return cast(list[int], torch.randint(0, _SEED_BOUND, (count,)).tolist())


def _generator(device: torch.device, seed: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _check_step_operands(
    op: str,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
) -> None:
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape:
            raise ValueError(f"{op}: {name} shape {tuple(t.shape)} != param shape {tuple(param.shape)}")
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{op}: {name} dtype {t.dtype} is not bf16 or fp32")
    if step < 1:
        raise ValueError(f"{op}: step={step} must be >= 1")


def copy_stochastic_(
    target: torch.Tensor,
    source: torch.Tensor,
    *,
    seed: int | None = None,
    backend: KernelBackend = KernelBackend.AUTO,
) -> torch.Tensor:
    """Copies fp32 ``source`` into bf16 ``target`` with stochastic rounding, in place.

    Each value becomes its upper bf16 neighbour with probability (x - lower) / (upper - lower) and
    its lower one otherwise, so the copy is unbiased in expectation (plain rounding to nearest loses
    updates smaller than half a bf16 step). NaN and infinity are copied unchanged.

    Args:
        target: bf16 destination.
        source: fp32 values of the same shape.
        seed: Seed of the random bits; drawn from torch's default CPU generator when None.
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        ``target``.

    Raises:
        ValueError: Dtypes or shapes do not fit.
    """
    if target.dtype != torch.bfloat16 or source.dtype != torch.float32 or target.shape != source.shape:
        raise ValueError(
            f"copy_stochastic_: target must be bf16 and source fp32 of the same shape, got target "
            f"{target.dtype} {tuple(target.shape)} and source {source.dtype} {tuple(source.shape)}"
        )
    resolved = _resolve_seed(seed)
    if use_triton(backend, "copy_stochastic_", target, source) and target.is_contiguous():
        from d9d.kernels._triton.stochastic_rounding_op import copy_stochastic_triton

        copy_stochastic_triton(target, source.contiguous(), resolved)
        return target
    target.copy_(stochastic_round_to_bf16_reference(source, _generator(source.device, resolved)))
    return target


def adamw_step_stochastic_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    step: int,
    seed: int | None = None,
    backend: KernelBackend = KernelBackend.AUTO,
) -> None:
    """One fused AdamW step on one parameter, in place, with stochastic rounding of bf16 storage.

    Reads the parameter, gradient and both moments once and writes the parameter and moments once
    (the Triton path is a single kernel). Math in fp32 as in ``torch.optim.AdamW`` (no amsgrad);
    whichever of ``param``, ``exp_avg``, ``exp_avg_sq`` are bf16 are written with stochastic
    rounding, fp32 ones exactly.

    Args:
        param: Parameter (bf16 or fp32), updated in place.
        grad: Its gradient, same shape (bf16 or fp32).
        exp_avg: First moment (bf16 or fp32), updated in place.
        exp_avg_sq: Second moment (bf16 or fp32), updated in place.
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the bias-corrected root of the second moment.
        weight_decay: Decoupled weight decay (multiplies ``param`` by ``1 - lr * weight_decay``).
        step: The step number, starting at 1, for bias correction.
        seed: Seed of the rounding bits; drawn from torch's default CPU generator when None.
        backend: Which implementation runs (Triton on CUDA by default).

    Raises:
        ValueError: Shapes or dtypes do not fit, or ``step`` < 1.
    """
    _check_step_operands("adamw_step_stochastic_", param, grad, exp_avg, exp_avg_sq, step)
    resolved = _resolve_seed(seed)
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if use_triton(backend, "adamw_step_stochastic_", *tensors) and all(t.is_contiguous() for t in tensors):
        from d9d.kernels._triton.stochastic_rounding_op import adamw_step_stochastic_triton

        adamw_step_stochastic_triton(
            param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, resolved
        )
        return
    adamw_step_reference(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        generator=_generator(param.device, resolved),
    )


def adamw_step_stochastic_multi_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    step: int,
    seeds: Sequence[int] | None = None,
    grad_scale: torch.Tensor | None = None,
    backend: KernelBackend = KernelBackend.AUTO,
) -> None:
    """``adamw_step_stochastic_`` over many parameters at once: one kernel launch on CUDA.

    The per-parameter op costs a launch and its Python per tensor, which for a model of a few
    hundred parameter tensors makes the optimizer step host-bound; this one reads every tensor's
    address from a table on the device. Parameter ``i`` is updated exactly as
    ``adamw_step_stochastic_`` with ``seed=seeds[i]`` would.

    Args:
        params: Parameters, updated in place; one dtype (bf16 or fp32) for all on the Triton path.
        grads: Their gradients, same shapes; one dtype for all.
        exp_avgs: First moments, updated in place; one dtype for all.
        exp_avg_sqs: Second moments, updated in place; one dtype for all.
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the bias-corrected root of the second moment.
        weight_decay: Decoupled weight decay.
        step: The step number shared by every parameter, starting at 1.
        seeds: One rounding seed per parameter; drawn from torch's default CPU generator when None.
        grad_scale: A one-element tensor the gradients still need to be multiplied by (e.g. a
            clipping factor computed on the device): the step uses ``grad_scale * grad`` in
            float32 as it reads each gradient and leaves ``grads`` unchanged, so the separate pass
            over the gradients that a multiplication costs is saved. Never read on the host.
        backend: Which implementation runs (Triton on CUDA by default).

    Raises:
        ValueError: The lists differ in length, ``grad_scale`` is not a one-element floating
            tensor, or a parameter's operands do not fit (named by its index).
    """
    count = len(params)
    if not len(grads) == len(exp_avgs) == len(exp_avg_sqs) == count:
        raise ValueError(
            f"adamw_step_stochastic_multi_: {count} params, {len(grads)} grads, {len(exp_avgs)} "
            f"exp_avgs and {len(exp_avg_sqs)} exp_avg_sqs: one of each per parameter"
        )
    if seeds is not None and len(seeds) != count:
        raise ValueError(f"adamw_step_stochastic_multi_: {len(seeds)} seeds for {count} params")
    if grad_scale is not None and (grad_scale.numel() != 1 or not grad_scale.is_floating_point()):
        raise ValueError(
            f"adamw_step_stochastic_multi_: grad_scale must be a one-element floating tensor, got "
            f"shape {tuple(grad_scale.shape)} of {grad_scale.dtype}"
        )
    for index, operands in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        _check_step_operands(f"adamw_step_stochastic_multi_ (parameter {index})", *operands, step)
    if count == 0:
        return
    resolved: list[int] = [s % _SEED_BOUND for s in seeds] if seeds is not None else draw_seeds(count)
    lists = (list(params), list(grads), list(exp_avgs), list(exp_avg_sqs))
    tensors = [t for group in lists for t in group]
    if (
        use_triton(backend, "adamw_step_stochastic_multi_", *tensors)
        and all(t.is_contiguous() for t in tensors)
        and all(len({t.dtype for t in group}) == 1 for group in lists)
        and len({t.device for t in tensors}) == 1
        and (grad_scale is None or grad_scale.device == tensors[0].device)
    ):
        from d9d.kernels._triton.stochastic_rounding_op import adamw_step_stochastic_multi_triton

        scale = None if grad_scale is None else grad_scale.detach().to(torch.float32).reshape(())
        adamw_step_stochastic_multi_triton(*lists, lr, beta1, beta2, eps, weight_decay, step, resolved, scale)
        return
    for param, grad, exp_avg, exp_avg_sq, seed in zip(*lists, resolved, strict=True):
        scaled = (
            grad if grad_scale is None else grad.to(torch.float32) * grad_scale.detach().float().reshape(())
        )
        adamw_step_stochastic_(
            param, scaled, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, step=step, seed=seed, backend=backend,
        )  # fmt: skip
