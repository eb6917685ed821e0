"""Backward kernels run as a graph node that refuses a second derivative, as the custom ops do."""

from collections.abc import Callable
from typing import Any

import torch


class _BackwardKernels(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: str, kernels: Callable[..., Any], *args: Any) -> Any:
        ctx.op = op
        return kernels(*args)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        raise RuntimeError(f"{ctx.op}: the Triton path is differentiable once; its backward has no gradient")


def run_backward_kernels(op: str, kernels: Callable[..., Any], *args: Any) -> Any:
    """Runs ``kernels(*args)`` inside an ``autograd.Function.backward``.

    Grad mode is on there only under ``create_graph=True``: the result is then recorded as a node
    whose own backward raises, naming ``op``, instead of silently having no gradient.
    """
    if torch.is_grad_enabled():
        return _BackwardKernels.apply(op, kernels, *args)
    return kernels(*args)
