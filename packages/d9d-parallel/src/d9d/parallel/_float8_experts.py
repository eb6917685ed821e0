"""FP8 grouped GEMMs for MoE experts: forward and input gradient in float8, weight gradient in bf16.

Tokens are cast to float8 (e4m3) with one scale per row, each expert's weight with one scale per
output column, and the product runs in PyTorch's rowwise-scaled grouped GEMM (Hopper and newer).
The input gradient does the same with the weight scaled per input row. The weight gradient stays a
bf16 grouped GEMM: its operands would need scales per column *within each expert's group of
tokens*, a pass over every routed row that costs more than FP8 saves at MoE widths (measured in
``benchmarks/float8_experts.py``). Scales are powers of two, so scaling is exact.

The gate and up products of a SwiGLU expert share their input: ``Float8GroupedMatmul.pair`` casts
it once, and their input gradients run as one GEMM over both (``[dgate | dup] @ [gate | up].T``).
"""

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from d9d.parallel._float8 import _FP8_ALIGNMENT  # pyright: ignore[reportPrivateUsage]
from d9d.parallel._float8_rowwise_casts import cast_rows, cast_weight_columns, cast_weight_rows
from d9d.parallel._float8_weight_casts import Float8WeightCasts


class GroupedMatmul(Protocol):
    """``out[rows of g] = x[rows of g] @ weight[g]`` (d9d-kernels' ``grouped_mm`` fits)."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor, /
    ) -> torch.Tensor:
        """Maps ``(M, K)`` rows grouped contiguously and ``(G, K, N)`` weights to ``(M, N)``."""
        ...


class SharedInputGroupedMatmul(Protocol):
    """``(x @ weight_a[g], x @ weight_b[g])`` per group of rows: two products of one input."""

    def __call__(
        self,
        x: torch.Tensor,
        weight_a: torch.Tensor,
        weight_b: torch.Tensor,
        tokens_per_group: torch.Tensor,
        /,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Maps ``(M, K)`` rows and two ``(G, K, N)`` weights to two ``(M, N)`` products."""
        ...


class GroupedExpertsLike(Protocol):
    """What ``convert_experts_to_float8`` needs of grouped experts (d9d-kernels'
    ``GroupedSwiGLUExperts`` fits): 3-d ``(E, K, N)`` weights run through a replaceable
    ``grouped_matmul``."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The module's parameters by name."""
        ...

    @property
    def grouped_matmul(self) -> GroupedMatmul:
        """The grouped GEMM the experts run their weights through; replaced here."""
        ...

    @grouped_matmul.setter
    def grouped_matmul(self, grouped_matmul: GroupedMatmul) -> None: ...

    @property
    def shared_input_matmul(self) -> SharedInputGroupedMatmul | None:
        """The pair of grouped GEMMs over one input (gate and up), if not two ``grouped_matmul``."""
        ...

    @shared_input_matmul.setter
    def shared_input_matmul(self, shared_input_matmul: SharedInputGroupedMatmul | None) -> None: ...


def _require_sm90(x: torch.Tensor) -> None:
    capability = torch.cuda.get_device_capability(x.device)
    if capability < (9, 0):
        raise RuntimeError(
            f"float8 experts need a CUDA GPU of compute capability 9.0 or newer "
            f"(_scaled_grouped_mm), got sm{capability[0]}{capability[1]}; turn float8 experts off"
        )


def _scaled_grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    group_ends: torch.Tensor,
) -> torch.Tensor:
    """bf16 ``(M, N)`` from float8 ``x`` ``(M, K)`` row-major and ``weight`` ``(G, K, N)``
    column-major per group, with dequantizing scales ``(M, 1)`` and ``(G, 1, N)``.

    On CUDA PyTorch's rowwise-scaled grouped GEMM with fast accumulation; elsewhere the
    reference: the dequantized operands multiplied per group in float32.
    """
    if weight.stride()[1:] != (1, weight.shape[1]):
        raise ValueError("float8 grouped GEMM: the weight must be column-major per group")
    if x.is_cuda:
        _require_sm90(x)
        output: torch.Tensor = torch._scaled_grouped_mm(  # pyright: ignore[reportPrivateUsage]
            x,
            weight,
            x_scale.squeeze(1),
            weight_scale.squeeze(1),
            offs=group_ends,
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
        return output
    ends: list[int] = [0, *cast(list[int], group_ends.tolist())]
    pieces = [
        (x[start:end].float() * x_scale[start:end]) @ (weight[group].float() * weight_scale[group])
        for group, (start, end) in enumerate(itertools.pairwise(ends))
    ]
    return torch.cat(pieces).to(torch.bfloat16)


def _grouped_weight_grad(x: torch.Tensor, grad: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """``(G, K, N)``: ``x[rows of g].T @ grad[rows of g]`` in bf16 (PyTorch's grouped GEMM on CUDA)."""
    if x.is_cuda:
        grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # pyright: ignore[reportPrivateUsage]
        output: torch.Tensor = grouped_mm(x.t(), grad, offs=group_ends)
        return output
    ends: list[int] = [0, *cast(list[int], group_ends.tolist())]
    pieces = [x[start:end].float().T @ grad[start:end].float() for start, end in itertools.pairwise(ends)]
    return torch.stack(pieces).to(grad.dtype)


def _input_grad(
    grad: tuple[torch.Tensor, torch.Tensor],
    weight: tuple[torch.Tensor, torch.Tensor],
    group_ends: torch.Tensor,
) -> torch.Tensor:
    """``grad @ weight.T`` per group from the float8 casts of both (with their scales)."""
    (g_data, g_scale), (w_data, w_scale) = grad, weight
    # weight.T per expert is (N, K): the row-major (K, N) storage is its column-major form
    return _scaled_grouped_mm(g_data, w_data.transpose(1, 2), g_scale, w_scale.transpose(1, 2), group_ends)


def _empty_like_or_nothing(t: torch.Tensor, needed: bool) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format) if needed else t.new_empty((0,))


def _given_or_cast(
    data: torch.Tensor | None,
    scale: torch.Tensor | None,
    cast: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight's float8 cast handed in (kept from an earlier microbatch), else a new one."""
    return (data, scale) if data is not None and scale is not None else cast()


# The weights' casts are optional inputs: ``Float8WeightCasts`` hands in the ones it keeps across
# microbatches (the row-major cast is saved for the input gradient); without them the ops cast.
@torch.library.custom_op("d9d_parallel::float8_grouped_mm", mutates_args=())
def _float8_grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_ends: torch.Tensor,
    columns: torch.Tensor | None = None,
    columns_scale: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    rows_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    x_data, x_scale = cast_rows(x)
    w_data, w_scale = _given_or_cast(columns, columns_scale, lambda: cast_weight_columns(weight))
    return _scaled_grouped_mm(x_data, w_data, x_scale, w_scale, group_ends).to(x.dtype)


@_float8_grouped_mm.register_fake
def _float8_grouped_mm_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_ends: torch.Tensor,
    columns: torch.Tensor | None = None,
    columns_scale: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    rows_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[2]))


@torch.library.custom_op("d9d_parallel::float8_grouped_mm_backward", mutates_args=())
def _float8_grouped_mm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    group_ends: torch.Tensor,
    rows: torch.Tensor | None,
    rows_scale: torch.Tensor | None,
    need_x: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad = grad.contiguous()
    grad_x = grad_weight = x.new_empty((0,))
    if need_x:
        weight_rows = _given_or_cast(rows, rows_scale, lambda: cast_weight_rows(weight))
        grad_x = _input_grad(cast_rows(grad), weight_rows, group_ends).to(x.dtype)
    if need_weight:
        grad_weight = _grouped_weight_grad(x.to(grad.dtype), grad, group_ends).to(weight.dtype)
    return grad_x, grad_weight


@_float8_grouped_mm_backward.register_fake
def _float8_grouped_mm_backward_fake(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    group_ends: torch.Tensor,
    rows: torch.Tensor | None,
    rows_scale: torch.Tensor | None,
    need_x: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_like_or_nothing(x, need_x), _empty_like_or_nothing(weight, need_weight)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, group_ends, _columns, _columns_scale, rows, rows_scale = inputs
    ctx.save_for_backward(x, weight, group_ends, rows, rows_scale)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, group_ends, rows, rows_scale = ctx.saved_tensors
    need_x, need_weight = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
    grad_x, grad_weight = _float8_grouped_mm_backward(
        grad, x, weight, group_ends, rows, rows_scale, need_x, need_weight
    )
    return (grad_x if need_x else None, grad_weight if need_weight else None, None, None, None, None, None)


_float8_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("d9d_parallel::float8_grouped_mm_pair", mutates_args=())
def _float8_grouped_mm_pair(
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    group_ends: torch.Tensor,
    columns_a: torch.Tensor | None = None,
    columns_a_scale: torch.Tensor | None = None,
    columns_b: torch.Tensor | None = None,
    columns_b_scale: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    rows_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    x_data, x_scale = cast_rows(x)  # once for both products
    outputs: list[torch.Tensor] = []
    for weight, columns, columns_scale in (
        (weight_a, columns_a, columns_a_scale),
        (weight_b, columns_b, columns_b_scale),
    ):
        w_data, w_scale = _given_or_cast(columns, columns_scale, lambda w=weight: cast_weight_columns(w))
        outputs.append(_scaled_grouped_mm(x_data, w_data, x_scale, w_scale, group_ends).to(x.dtype))
    return outputs[0], outputs[1]


@_float8_grouped_mm_pair.register_fake
def _float8_grouped_mm_pair_fake(
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    group_ends: torch.Tensor,
    columns_a: torch.Tensor | None = None,
    columns_a_scale: torch.Tensor | None = None,
    columns_b: torch.Tensor | None = None,
    columns_b_scale: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    rows_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((x.shape[0], weight_a.shape[2])), x.new_empty((x.shape[0], weight_b.shape[2]))


@torch.library.custom_op("d9d_parallel::float8_grouped_mm_pair_backward", mutates_args=())
def _float8_grouped_mm_pair_backward(
    grad_a: torch.Tensor,
    grad_b: torch.Tensor,
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    group_ends: torch.Tensor,
    rows: torch.Tensor | None,
    rows_scale: torch.Tensor | None,
    need_x: bool,
    need_weight_a: bool,
    need_weight_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_a, grad_b = grad_a.contiguous(), grad_b.contiguous()
    grad_x = grad_weight_a = grad_weight_b = x.new_empty((0,))
    if need_x:
        # [grad_a | grad_b] @ [weight_a | weight_b].T: one GEMM over both, one scale per row
        weight_rows = _given_or_cast(rows, rows_scale, lambda: cast_weight_rows(weight_a, weight_b))
        grad_x = _input_grad(cast_rows(grad_a, grad_b), weight_rows, group_ends).to(x.dtype)
    if need_weight_a:
        grad_weight_a = _grouped_weight_grad(x.to(grad_a.dtype), grad_a, group_ends).to(weight_a.dtype)
    if need_weight_b:
        grad_weight_b = _grouped_weight_grad(x.to(grad_b.dtype), grad_b, group_ends).to(weight_b.dtype)
    return grad_x, grad_weight_a, grad_weight_b


@_float8_grouped_mm_pair_backward.register_fake
def _float8_grouped_mm_pair_backward_fake(
    grad_a: torch.Tensor,
    grad_b: torch.Tensor,
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    group_ends: torch.Tensor,
    rows: torch.Tensor | None,
    rows_scale: torch.Tensor | None,
    need_x: bool,
    need_weight_a: bool,
    need_weight_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        _empty_like_or_nothing(x, need_x),
        _empty_like_or_nothing(weight_a, need_weight_a),
        _empty_like_or_nothing(weight_b, need_weight_b),
    )


def _setup_pair_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight_a, weight_b, group_ends, *_columns, rows, rows_scale = inputs
    ctx.save_for_backward(x, weight_a, weight_b, group_ends, rows, rows_scale)


def _pair_backward(ctx: Any, grad_a: torch.Tensor, grad_b: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight_a, weight_b, group_ends, rows, rows_scale = ctx.saved_tensors
    need = [bool(n) for n in ctx.needs_input_grad[:3]]
    grads = _float8_grouped_mm_pair_backward(
        grad_a, grad_b, x, weight_a, weight_b, group_ends, rows, rows_scale, *need
    )
    grad_x, grad_weight_a, grad_weight_b = (g if n else None for g, n in zip(grads, need, strict=True))
    return grad_x, grad_weight_a, grad_weight_b, None, None, None, None, None, None, None


_float8_grouped_mm_pair.register_autograd(_pair_backward, setup_context=_setup_pair_context)


def _check_alignment(x: torch.Tensor, *weights: torch.Tensor) -> None:
    for weight in weights:
        if x.shape[1] % _FP8_ALIGNMENT or weight.shape[2] % _FP8_ALIGNMENT:
            raise ValueError(
                f"float8 experts need both weight dims to be multiples of 16, got {tuple(weight.shape)}"
            )


class Float8GroupedMatmul:
    """FP8 rowwise grouped GEMM for MoE experts (a ``GroupedMatmul``).

    The forward product and the input gradient run in float8 with one power-of-two scale per
    token row and per weight column (per weight row for the input gradient); the weight
    gradient runs in bf16. Group sizes need no padding and cause no host sync on CUDA. Off CUDA
    a reference runs (the same quantization, the products in float32), for tests.

    With ``weight_casts`` the weights' float8 casts are kept from one microbatch to the next
    (``Float8WeightCasts``: clear it after each optimizer step); without it each call casts them.
    """

    def __init__(self, weight_casts: Float8WeightCasts | None = None) -> None:
        """Args:
        weight_casts: Where the weights' casts are kept within a step (None: cast per call).
        """
        self._weight_casts = weight_casts

    @property
    def weight_casts(self) -> Float8WeightCasts | None:
        """Where the weights' casts are kept across microbatches (None: cast per call)."""
        return self._weight_casts

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor, /
    ) -> torch.Tensor:
        """``x`` ``(M, K)`` rows grouped contiguously, ``weight`` ``(G, K, N)``: ``(M, N)``.

        Raises:
            RuntimeError: On a CUDA GPU older than compute capability 9.0.
            ValueError: If ``K`` or ``N`` is not a multiple of 16.
        """
        _check_alignment(x, weight)
        group_ends = torch.cumsum(tokens_per_group, dim=0, dtype=torch.int32)
        if self._weight_casts is None:
            return _float8_grouped_mm(x, weight, group_ends)
        casts = self._weight_casts.casts(weight)
        (columns, columns_scale), (rows, rows_scale) = casts.columns[0], casts.rows
        return _float8_grouped_mm(x, weight, group_ends, columns, columns_scale, rows, rows_scale)

    def pair(
        self,
        x: torch.Tensor,
        weight_a: torch.Tensor,
        weight_b: torch.Tensor,
        tokens_per_group: torch.Tensor,
        /,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x @ weight_a[g], x @ weight_b[g])`` per group (a ``SharedInputGroupedMatmul``).

        The same products as two calls, with ``x`` cast to float8 once and both input gradients
        in one GEMM.

        Raises:
            RuntimeError: On a CUDA GPU older than compute capability 9.0.
            ValueError: If ``K`` or ``N`` of either weight is not a multiple of 16.
        """
        _check_alignment(x, weight_a, weight_b)
        group_ends = torch.cumsum(tokens_per_group, dim=0, dtype=torch.int32)
        if self._weight_casts is None:
            return _float8_grouped_mm_pair(x, weight_a, weight_b, group_ends)
        casts = self._weight_casts.casts(weight_a, weight_b)
        (columns_a, scale_a), (columns_b, scale_b) = casts.columns
        return _float8_grouped_mm_pair(
            x, weight_a, weight_b, group_ends, columns_a, scale_a, columns_b, scale_b, *casts.rows
        )


def convert_experts_to_float8(
    experts: GroupedExpertsLike, weight_casts: Float8WeightCasts | None = None
) -> None:
    """Runs ``experts``' grouped GEMMs in FP8 rowwise (``Float8GroupedMatmul``), in place.

    Both slots are set: ``grouped_matmul`` and ``shared_input_matmul`` (the gate and up
    products, which share their input). The weights stay what they are (names, dtype,
    sharding); the router and the token permute are untouched. Forward then needs a Hopper or
    newer GPU and bf16 compute.

    Args:
        experts: The grouped experts to convert.
        weight_casts: Keeps the weights' float8 casts across microbatches until its ``clear``
            (call it after every optimizer step); one object may serve every layer. None: the
            weights are cast in every forward and backward.

    Raises:
        ValueError: If a 3-d weight has a dim that is not a multiple of 16.
    """
    for name, parameter in experts.named_parameters():
        if parameter.dim() == 3 and (
            parameter.shape[1] % _FP8_ALIGNMENT or parameter.shape[2] % _FP8_ALIGNMENT
        ):
            raise ValueError(
                f"float8 experts: weight {name!r} of shape {tuple(parameter.shape)} has a dim that is "
                "not a multiple of 16"
            )
    matmul = Float8GroupedMatmul(weight_casts)
    experts.grouped_matmul = matmul
    experts.shared_input_matmul = matmul.pair
