"""The few-rows linear as a ``torch.library`` custom op (inference only: no autograd)."""

import torch
import torch.nn.functional as F

FEW_ROWS_MAX = 16
"""Inputs of more rows than this go to ``F.linear`` (cuBLAS is as fast there)."""

FEW_ROWS_GROUP_MAX = 64
"""A group's limit: one launch for q/k/v (gate/up) of 64 rows beat cuBLAS's three (two) on the H200."""

WIDE_GROUP_MAX_ELEMENTS = 32 * 2**20
"""Past ``FEW_ROWS_MAX`` rows, only groups of at most this many weight elements take one launch.

On the H200 at 64 rows: Qwen3-0.6B q/k/v (4M) 2.02x cuBLAS, gate/up (6M) 1.30x, Qwen3-8B q/k/v
(25M) 1.24x, but 8B gate/up (101M) 0.82x: cuBLAS's tiles reach the bandwidth on large weights.
"""


def group_takes_one_launch(rows: int, weights: list[torch.Tensor]) -> bool:
    """Whether ``rows`` rows times ``weights`` go through the group kernel (else per-weight cuBLAS)."""
    if rows <= FEW_ROWS_MAX:
        return True
    return rows <= FEW_ROWS_GROUP_MAX and sum(w.numel() for w in weights) <= WIDE_GROUP_MAX_ELEMENTS


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] > FEW_ROWS_MAX:
        return F.linear(x, weight, bias)
    from d9d.kernels._triton.few_rows_linear_kernels import few_rows_linear_kernel

    return few_rows_linear_kernel(x, weight, bias)


@torch.library.custom_op("d9d_kernels::few_rows_linear", mutates_args=())
def _few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _launch(x, weight, bias)  # decided when the op runs: a dynamic row count adds no guard


@_few_rows_linear.register_fake
def _few_rows_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def few_rows_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(m, n)`` product through the Triton kernels; see ``d9d.kernels.few_rows_linear``.

    The custom op under torch.compile (one opaque node in the graph), a direct launch in eager mode.
    """
    if torch.compiler.is_compiling():
        return _few_rows_linear(x, weight, bias)
    return _launch(x, weight, bias)


def _launch_group(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    if not group_takes_one_launch(x.shape[0], weights):
        if biases is None:
            return [F.linear(x, weight) for weight in weights]
        return [F.linear(x, weight, bias) for weight, bias in zip(weights, biases, strict=True)]
    from d9d.kernels._triton.few_rows_linear_kernels import few_rows_linear_group_kernel

    return few_rows_linear_group_kernel(x, weights, biases)


# A fixed arity of three (a smaller group fills the rest with empty weights of no rows), and no
# list arguments: the schema types every supported torch version infers.
@torch.library.custom_op("d9d_kernels::few_rows_linear_group", mutates_args=())
def _few_rows_linear_group(
    x: torch.Tensor,
    w0: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b0: torch.Tensor | None,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    biases = None if b0 is None or b1 is None or b2 is None else [b0, b1, b2]
    y0, y1, y2 = _launch_group(x, [w0, w1, w2], biases)
    return y0, y1, y2


@_few_rows_linear_group.register_fake
def _few_rows_linear_group_fake(
    x: torch.Tensor,
    w0: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b0: torch.Tensor | None,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    return (
        x.new_empty((rows, w0.shape[0])),
        x.new_empty((rows, w1.shape[0])),
        x.new_empty((rows, w2.shape[0])),
    )


def few_rows_linear_group_triton(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """Each ``(m, n_i)`` product of ``x`` with ``weights[i]`` (one to three) in one launch; see
    ``d9d.kernels.few_rows_linear_group``. The custom op under torch.compile, a direct launch in
    eager mode."""
    if not torch.compiler.is_compiling():
        return _launch_group(x, weights, biases)
    count = len(weights)
    empty = weights[0][:0]
    padded = [*weights, *[empty] * (3 - count)]
    padded_biases: list[torch.Tensor | None] = (
        [None] * 3 if biases is None else [*biases, *[biases[0][:0]] * (3 - count)]
    )
    outs = _few_rows_linear_group(x, *padded, *padded_biases)
    return list(outs[:count])


def _launch_swiglu(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    if not group_takes_one_launch(x.shape[0], [gate_weight, up_weight]):
        from d9d.kernels._triton.swiglu_kernels import swiglu_forward

        b_gate, b_up = biases if biases is not None else (None, None)
        return swiglu_forward(F.linear(x, gate_weight, b_gate), F.linear(x, up_weight, b_up))
    from d9d.kernels._triton.few_rows_swiglu_kernels import few_rows_swiglu_kernel

    return few_rows_swiglu_kernel(x, gate_weight, up_weight, biases)


@torch.library.custom_op("d9d_kernels::few_rows_swiglu", mutates_args=())
def _few_rows_swiglu(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_bias: torch.Tensor | None,
) -> torch.Tensor:
    biases = None if gate_bias is None or up_bias is None else (gate_bias, up_bias)
    return _launch_swiglu(x, gate_weight, up_weight, biases)


@_few_rows_swiglu.register_fake
def _few_rows_swiglu_fake(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_bias: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], gate_weight.shape[0]))


def few_rows_swiglu_triton(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """``(m, n)`` ``silu(x @ gate_weight.T) * (x @ up_weight.T)`` in one launch; see
    ``d9d.kernels.few_rows_swiglu``. The custom op under torch.compile, a direct launch in eager mode."""
    if torch.compiler.is_compiling():
        b_gate, b_up = biases if biases is not None else (None, None)
        return _few_rows_swiglu(x, gate_weight, up_weight, b_gate, b_up)
    return _launch_swiglu(x, gate_weight, up_weight, biases)
