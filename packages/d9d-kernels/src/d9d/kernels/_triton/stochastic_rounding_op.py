"""Stochastic rounding and the AdamW step as mutating ``torch.library`` custom ops."""

import torch


@torch.library.custom_op("d9d_kernels::copy_stochastic", mutates_args=("target",))
def _copy_stochastic(target: torch.Tensor, source: torch.Tensor, seed: int) -> None:
    from d9d.kernels._triton.stochastic_rounding_kernels import copy_stochastic

    copy_stochastic(target, source, seed)


@torch.library.custom_op(
    "d9d_kernels::adamw_step_stochastic", mutates_args=("param", "exp_avg", "exp_avg_sq")
)
def _adamw_step(
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
    from d9d.kernels._triton.stochastic_rounding_kernels import adamw_step

    adamw_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, seed)


@torch.library.custom_op(
    "d9d_kernels::adamw_step_stochastic_multi", mutates_args=("params", "exp_avgs", "exp_avg_sqs")
)
def _adamw_step_multi(
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
    grad_scale: torch.Tensor | None,
) -> None:
    from d9d.kernels._triton.stochastic_rounding_kernels import adamw_step_multi

    adamw_step_multi(
        params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, seeds, grad_scale
    )


_INT32_ELEMENTS = 2**31


def _check_size(op: str, t: torch.Tensor) -> None:
    if t.numel() >= _INT32_ELEMENTS:
        raise ValueError(f"{op}: {t.numel()} elements exceed the kernel's 2**31 random-offset range")


def copy_stochastic_triton(target: torch.Tensor, source: torch.Tensor, seed: int) -> None:
    """Stochastic-rounding copy through the Triton kernel; see ``d9d.kernels.copy_stochastic_``."""
    _check_size("copy_stochastic_", source)
    _copy_stochastic(target, source, seed)


def adamw_step_stochastic_triton(
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
    """The fused AdamW step through the Triton kernel; see ``d9d.kernels.adamw_step_stochastic_``."""
    _check_size("adamw_step_stochastic_", param)
    _adamw_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, seed)


def adamw_step_stochastic_multi_triton(
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
    grad_scale: torch.Tensor | None,
) -> None:
    """The multi-tensor AdamW step in one launch; see ``d9d.kernels.adamw_step_stochastic_multi_``."""
    for param in params:
        _check_size("adamw_step_stochastic_multi_", param)
    _adamw_step_multi(
        params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, seeds, grad_scale
    )
