"""AdamW for bf16 parameters with stochastic rounding."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch.distributed.tensor import DTensor

from d9d.kernels._backend import KernelBackend
from d9d.kernels._stochastic_rounding import adamw_step_stochastic_multi_


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class StochasticAdamW(torch.optim.Optimizer):
    """AdamW whose update of bf16 parameters (and bf16 moments) uses stochastic rounding.

    Training directly in bf16 loses every update smaller than half a bf16 step when rounding to
    nearest; stochastic rounding keeps them in expectation, which lets bf16 parameters train without
    an fp32 master copy. On CUDA one fused kernel updates every parameter of a group that shares
    a step count and dtypes (``adamw_step_stochastic_multi_``).

    State per parameter: ``step`` (a CPU fp32 scalar tensor), ``exp_avg`` and ``exp_avg_sq`` (shaped
    like the parameter, of ``state_dtype`` or the parameter's dtype). DTensor parameters are updated
    through their local shards.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        state_dtype: torch.dtype | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        """Creates the optimizer.

        Args:
            params: Parameters or parameter groups.
            lr: Learning rate.
            betas: Decays of the first and second moments.
            eps: Added to the bias-corrected root of the second moment.
            weight_decay: Decoupled weight decay.
            state_dtype: Dtype of the moments (bf16 or fp32); the parameter's dtype when None.
            backend: Which implementation of the step runs.
        """
        if lr < 0.0:
            raise ValueError(f"StochasticAdamW: lr={lr} must be >= 0")
        if state_dtype not in (None, torch.bfloat16, torch.float32):
            raise ValueError(f"StochasticAdamW: state_dtype={state_dtype} is not bf16, fp32 or None")
        defaults: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self._state_dtype = state_dtype
        self._backend = backend
        self._gradient_scale: torch.Tensor | None = None

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step over every parameter that has a gradient."""
        loss: float | None = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(self._gradient_scale)
        return loss

    def step_with_gradient_scale(self, scale: torch.Tensor) -> None:
        """One step as if every gradient were first multiplied by ``scale``; gradients stay as they are.

        The factor (e.g. a gradient-clipping coefficient, a one-element tensor on the parameters'
        device, never read on the host) is applied inside the kernel that reads the gradients, which
        saves a whole pass over them. Runs through ``step()``, so step hooks and an LR scheduler's
        step tracking see it as a step.
        """
        self._gradient_scale = scale
        try:
            self.step()
        finally:
            self._gradient_scale = None

    def _step(self, scale: torch.Tensor | None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            stepped = [param for param in group["params"] if param.grad is not None]
            for param in stepped:
                state = self.state[param]
                if not state:
                    dtype = self._state_dtype or param.dtype
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)
                state["step"] += 1
            # One launch per (step, device, dtypes): parameters that missed steps lag behind.
            buckets: dict[tuple[Any, ...], list[tuple[torch.Tensor, ...]]] = defaultdict(list)
            for param in stepped:
                state = self.state[param]
                operands = tuple(
                    _local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
                )
                key = (int(state["step"].item()), operands[0].device, *(t.dtype for t in operands))
                buckets[key].append(operands)
            for key, members in buckets.items():
                params, grads, exp_avgs, exp_avg_sqs = (list(column) for column in zip(*members, strict=True))
                adamw_step_stochastic_multi_(
                    params, grads, exp_avgs, exp_avg_sqs, lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"], step=key[0],
                    grad_scale=None if scale is None else scale.to(key[1]), backend=self._backend,
                )  # fmt: skip
