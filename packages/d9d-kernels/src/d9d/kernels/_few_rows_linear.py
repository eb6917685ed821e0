"""``F.linear`` for inputs of a few rows (decode steps): the public op and a mode that routes to it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from d9d.kernels._backend import KernelBackend, use_triton

_OP = "few_rows_linear"
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def few_rows_linear(
    input: torch.Tensor,  # F.linear's argument names: the mode passes its keywords on
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: KernelBackend = KernelBackend.AUTO,
) -> torch.Tensor:
    """``F.linear(input, weight, bias)``, through a Triton kernel when ``input`` has at most 16 rows.

    A decode step multiplies one to a few rows by every weight: the time is the weight's bytes over
    the bandwidth the launch reaches, and cuBLAS's tiles for these shapes reach a fraction of it
    (on an H200 a 1024 x 1024 weight takes 7.7 us against 2.6 us here; measured in
    docs/kernels-ops.md). The kernel splits the output columns over the GPU and streams their
    weight rows; products accumulate in fp32 and are rounded once. Inputs of more rows, tensor
    subclasses (DTensor, FP8 weights), tensors that need gradients, and anything the Triton
    backend cannot take go to ``F.linear`` unchanged. Inference only: the kernel path has no
    backward. Under ``torch.compile`` it is one custom op that decides by the row count when it
    runs, so a dynamic row count adds no guard.

    Args:
        input: ``(..., k)``; rows are the product of the leading dims.
        weight: ``(n, k)``.
        bias: ``(n,)`` or None.
        backend: Which implementation runs (the Triton kernel on CUDA by default); REFERENCE is
            ``F.linear``.

    Returns:
        ``(..., n)`` in ``input``'s dtype.

    Raises:
        ValueError: ``weight`` is not 2-D, its columns differ from ``input``'s last dim, or ``bias``
            is not ``(n,)``.
    """
    if weight.dim() != 2 or input.dim() == 0 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{_OP}: input {tuple(input.shape)} and weight {tuple(weight.shape)} do not fit: weight "
            "must be (n, k) with k the input's last dim"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{_OP}: bias {tuple(bias.shape)} must be ({weight.shape[0]},) for this weight")
    tensors = (input, weight) if bias is None else (input, weight, bias)
    if not _kernel_can_take(tensors) or not use_triton(backend, _OP, *tensors):
        return F.linear(input, weight, bias)
    from d9d.kernels._triton.few_rows_linear_op import few_rows_linear_triton

    rows = input.reshape(-1, input.shape[-1])
    out = few_rows_linear_triton(
        rows if rows.stride(-1) == 1 else rows.contiguous(),
        weight if weight.stride(-1) == 1 else weight.contiguous(),
        bias if bias is None or bias.stride(0) == 1 else bias.contiguous(),
    )
    return out.view(*input.shape[:-1], weight.shape[0])


def _kernel_can_take(tensors: Sequence[torch.Tensor]) -> bool:
    if any(type(t) not in _PLAIN for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    dtype = tensors[0].dtype
    return all(t.dtype == dtype for t in tensors)


class FewRowsLinearMode(TorchFunctionMode):
    """While active, every ``F.linear`` call (``nn.Linear`` included) goes through ``few_rows_linear``.

    For a decode step's forward: the model's own modules run unchanged, and the products of a few
    rows take the kernel (the rest fall back to ``F.linear`` inside ``few_rows_linear``). Every
    other torch function passes through untouched. Enter it around the step's model call; under a
    CUDA graph capture the graph records the kernels, under ``torch.compile`` the custom op.

    Args:
        backend: Passed to ``few_rows_linear`` (tests force TRITON on CPU in Triton's interpreter).
    """

    def __init__(self, *, backend: KernelBackend = KernelBackend.AUTO) -> None:
        super().__init__()
        self._backend = backend

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return few_rows_linear(*args, backend=self._backend, **kwargs)
        return func(*args, **kwargs)
