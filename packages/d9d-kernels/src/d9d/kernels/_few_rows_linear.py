"""``F.linear`` for inputs of a few rows (decode steps): the public op and a mode that routes to it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._shared_input_linear import shared_input_linear, swiglu_projection
from d9d.kernels._swiglu import swiglu

_OP = "few_rows_linear"
_GROUP_ROWS_MAX = 64  # a group's (few_rows_linear_op.FEW_ROWS_GROUP_MAX)
_GROUP_MAX = 3  # weights per launch (few_rows_linear_kernels.GROUP_MAX)
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


def _group_fits(
    input: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    backend: KernelBackend,
) -> bool:
    """Whether one launch can take the group (else each product goes through ``few_rows_linear``)."""
    present = [bias for bias in biases if bias is not None]
    tensors = (input, *weights, *present)
    return (
        1 <= len(weights) <= _GROUP_MAX
        and input.dim() > 0
        and len(present) in (0, len(weights))
        and all(w.dim() == 2 and w.shape[1] == input.shape[-1] for w in weights)
        and all(b is None or tuple(b.shape) == (w.shape[0],) for w, b in zip(weights, biases, strict=True))
        and input.numel() <= _GROUP_ROWS_MAX * input.shape[-1]
        and _kernel_can_take(tensors)
        and use_triton(backend, _OP, *tensors)
    )


def _kernel_can_take(tensors: Sequence[torch.Tensor]) -> bool:
    if any(type(t) not in _PLAIN for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    dtype = tensors[0].dtype
    return all(t.dtype == dtype for t in tensors)


def few_rows_linear_group(
    input: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    *,
    backend: KernelBackend = KernelBackend.AUTO,
) -> tuple[torch.Tensor, ...]:
    """``F.linear(input, weights[i], biases[i])`` for each weight, in one Triton launch when it can.

    One input's projections (q/k/v, gate/up) read their weights in one launch instead of one
    each: the programs split over every weight's columns. The launch takes at most 16 rows, or up
    to 64 for groups of at most 32M weight elements (past 16 rows, where larger weights reach the
    bandwidth through cuBLAS, the products go to ``F.linear`` one by one), up to
    three weights of the same inner dim and dtype, and biases for all of them or none; otherwise
    each product goes through ``few_rows_linear`` alone (the same fall-backs). Inference only.

    Args:
        input: ``(..., k)``.
        weights: Each ``(n_i, k)``.
        biases: Each ``(n_i,)`` or None; None: no biases.
        backend: As for ``few_rows_linear``.

    Returns:
        Each ``(..., n_i)`` product, in order.

    Raises:
        ValueError: A weight or bias does not fit, as for ``few_rows_linear``, or ``biases`` has
            another length than ``weights``.
    """
    bias_list = [None] * len(weights) if biases is None else list(biases)
    if len(bias_list) != len(weights):
        raise ValueError(f"{_OP}: {len(bias_list)} biases for {len(weights)} weights")
    if not _group_fits(input, weights, bias_list, backend):
        return tuple(
            few_rows_linear(input, w, b, backend=backend) for w, b in zip(weights, bias_list, strict=True)
        )
    present = [bias for bias in bias_list if bias is not None]
    from d9d.kernels._triton.few_rows_linear_op import few_rows_linear_group_triton

    rows = input.reshape(-1, input.shape[-1])
    outs = few_rows_linear_group_triton(
        rows if rows.stride(-1) == 1 else rows.contiguous(),
        [w if w.stride(-1) == 1 else w.contiguous() for w in weights],
        [b if b.stride(0) == 1 else b.contiguous() for b in present] if present else None,
    )
    return tuple(out.view(*input.shape[:-1], out.shape[-1]) for out in outs)


def few_rows_swiglu(
    input: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    *,
    backend: KernelBackend = KernelBackend.AUTO,
) -> torch.Tensor:
    """``swiglu(F.linear(input, gate_weight, gate_bias), F.linear(input, up_weight, up_bias))`` in one
    Triton launch when it can.

    A decode step's feed-forward input side: each program streams both weights' rows for its
    columns, reads each tile of ``input`` once for the two, and applies the activation before
    storing, so neither product is written and no activation kernel follows. Each product is
    rounded once to ``input``'s dtype before ``silu(gate) * up`` is computed in fp32, as the
    unfused ops round. The launch takes the rows and weights ``few_rows_linear_group`` takes
    (both biases or none); otherwise the products go through ``few_rows_linear_group`` and the
    ``swiglu`` op. Inference only.

    Args:
        input: ``(..., k)``.
        gate_weight: ``(n, k)``.
        up_weight: ``(n, k)``.
        gate_bias: ``(n,)`` or None.
        up_bias: ``(n,)`` or None.
        backend: As for ``few_rows_linear``.

    Returns:
        ``(..., n)`` in ``input``'s dtype.

    Raises:
        ValueError: The weights differ in shape, or a weight or bias does not fit ``input`` (as for
            ``few_rows_linear``).
    """
    if gate_weight.shape != up_weight.shape:
        raise ValueError(
            f"few_rows_swiglu: gate weight {tuple(gate_weight.shape)} and up weight "
            f"{tuple(up_weight.shape)} must have the same shape"
        )
    weights, biases = [gate_weight, up_weight], [gate_bias, up_bias]
    if not _group_fits(input, weights, biases, backend):
        gated, upped = few_rows_linear_group(input, weights, biases, backend=backend)
        return swiglu(gated, upped, backend=backend)
    from d9d.kernels._triton.few_rows_linear_op import few_rows_swiglu_triton

    rows = input.reshape(-1, input.shape[-1])
    out = few_rows_swiglu_triton(
        rows if rows.stride(-1) == 1 else rows.contiguous(),
        gate_weight if gate_weight.stride(-1) == 1 else gate_weight.contiguous(),
        up_weight if up_weight.stride(-1) == 1 else up_weight.contiguous(),
        None if gate_bias is None or up_bias is None else (gate_bias.contiguous(), up_bias.contiguous()),
    )
    return out.view(*input.shape[:-1], gate_weight.shape[0])


class FewRowsLinearMode(TorchFunctionMode):
    """While active, every ``F.linear`` call (``nn.Linear`` included) goes through ``few_rows_linear``;
    with ``group_projections``, every ``shared_input_linear`` of plain ``nn.Linear`` modules goes
    through ``few_rows_linear_group``, and every ``swiglu_projection`` of two through ``few_rows_swiglu``.

    For a decode step's forward: the model's own modules run unchanged, and the products of a few
    rows take the kernel (the rest fall back to ``F.linear`` inside ``few_rows_linear``); grouped,
    one input's projections (q/k/v, gate/up) take one launch. Every other torch function passes
    through untouched.
    Enter it around the step's model call; under a CUDA graph capture the graph records the
    kernels, under ``torch.compile`` the custom ops.

    Args:
        backend: Passed to ``few_rows_linear`` (tests force TRITON on CPU in Triton's interpreter).
        group_projections: Route ``shared_input_linear`` to ``few_rows_linear_group`` (the
            rollout engine turns it on: ``EmbeddedEngineConfig.few_rows_linear_group``).
    """

    def __init__(
        self, *, backend: KernelBackend = KernelBackend.AUTO, group_projections: bool = False
    ) -> None:
        super().__init__()
        self._backend = backend
        self._group = group_projections

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
        if func is shared_input_linear:
            input, linears = args
            # modules with hooks (tensor parallelism's) or of another type (LoRA, FP8) run themselves
            if self._group and all(
                type(linear) is nn.Linear and not _has_hooks(linear) for linear in linears
            ):
                plain = cast(Sequence[nn.Linear], linears)
                weights = [linear.weight for linear in plain]
                biases = [linear.bias for linear in plain]
                if _group_fits(input, weights, biases, self._backend):
                    return few_rows_linear_group(input, weights, biases, backend=self._backend)
            with self:  # a mode is off while it handles a call: on again, each module's linears come here
                return tuple(linear(input) for linear in linears)
        if func is swiglu_projection:
            return self._swiglu_projection(*args)
        return func(*args, **kwargs)

    def _swiglu_projection(self, input: torch.Tensor, gate: nn.Module, up: nn.Module) -> torch.Tensor:
        if self._group and all(type(linear) is nn.Linear and not _has_hooks(linear) for linear in (gate, up)):
            plain = cast(tuple[nn.Linear, nn.Linear], (gate, up))
            if plain[0].weight.shape == plain[1].weight.shape:  # the op decides launch or fall-back
                return few_rows_swiglu(
                    input,
                    plain[0].weight,
                    plain[1].weight,
                    plain[0].bias,
                    plain[1].bias,
                    backend=self._backend,
                )
        with self:  # the products as a group (or module by module), then the activation
            gated, upped = shared_input_linear(input, (gate, up))
            return swiglu(gated, upped)


def _has_hooks(module: nn.Module) -> bool:
    hooks: int = len(module._forward_hooks) + len(module._forward_pre_hooks)  # pyright: ignore
    return hooks > 0
