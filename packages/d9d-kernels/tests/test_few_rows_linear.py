"""few_rows_linear and FewRowsLinearMode: the kernels against F.linear, the fall-backs, the mode."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from d9d.kernels import FewRowsLinearMode, KernelBackend, few_rows_linear

_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)
_TRITON = KernelBackend.TRITON


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", *, bias: bool = True):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).to(device, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=generator).to(device, dtype) if bias else None
    return x, weight, b


def _assert_rounded_product(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
):
    """``out`` is the float64 product rounded once to its dtype (plus the fp32 summation's error)."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == x.dtype and out.shape == exact.shape
    ulp = torch.finfo(x.dtype).eps
    tolerance = ulp * exact.abs() + 1e-5 * (x.double().abs() @ weight.double().abs().T + 1)
    excess = (out.double() - exact).abs() - tolerance
    assert excess.max().item() <= 0, f"off by up to {(out.double() - exact).abs().max().item():.3g}"


@_INTERPRETER
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_kernels_round_the_exact_product_once(rows: int, dtype: torch.dtype, bias: bool) -> None:
    # 70 and 37: neither the columns nor the inner dim a multiple of the interpreter's tiles
    x, weight, b = _operands(rows, 37, 70, dtype, bias=bias)
    _assert_rounded_product(few_rows_linear(x, weight, b, backend=_TRITON), x, weight, b)


@_INTERPRETER
def test_leading_dims_and_strided_operands_keep_f_linear_shapes() -> None:
    x, weight, b = _operands(4, 24, 40, torch.float32)
    batched = x.view(2, 2, 1, 40)
    out = few_rows_linear(batched, weight, b, backend=_TRITON)
    assert out.shape == (2, 2, 1, 24)
    _assert_rounded_product(out.view(4, 24), x, weight, b)
    wide = torch.zeros(24, 80)
    wide[:, ::2] = weight  # a weight whose rows are strided: copied to contiguous first
    x_strided = torch.zeros(4, 80)
    x_strided[:, ::2] = x
    out = few_rows_linear(x_strided[:, ::2], wide[:, ::2], b, backend=_TRITON)
    _assert_rounded_product(out, x, weight, b)


@_INTERPRETER
@pytest.mark.parametrize("rows", [17, 40, 64])
def test_direct_launches_past_sixteen_rows_round_the_exact_product_once(rows: int) -> None:
    # the op stops at 16 rows; the benchmark launches the kernels at 32- and 64-row tiles directly
    from d9d.kernels._triton.few_rows_linear_kernels import (
        few_rows_linear_group_kernel,
        few_rows_linear_kernel,
    )

    x, weight, b = _operands(rows, 37, 70, torch.float32)
    _assert_rounded_product(few_rows_linear_kernel(x, weight, b), x, weight, b)
    _, second, second_bias = _operands(rows + 1, 21, 70, torch.float32)
    outs = few_rows_linear_group_kernel(x, [weight, second], [b, second_bias])
    _assert_rounded_product(outs[0], x, weight, b)
    _assert_rounded_product(outs[1], x, second, second_bias)


@_INTERPRETER
def test_more_rows_than_the_kernel_takes_are_f_linear_exactly() -> None:
    x, weight, b = _operands(17, 24, 40, torch.float32)
    assert torch.equal(few_rows_linear(x, weight, b, backend=_TRITON), F.linear(x, weight, b))


def test_tensors_that_need_gradients_fall_back_and_stay_differentiable() -> None:
    x, weight, b = _operands(2, 8, 16, torch.float32)
    weight.requires_grad_(True)
    out = few_rows_linear(x, weight, b, backend=_TRITON)  # F.linear: no Triton launch on CPU tensors
    out.sum().backward()
    assert weight.grad is not None
    torch.testing.assert_close(weight.grad, x.sum(0).expand(8, 16))


def test_reference_backend_and_cpu_auto_are_f_linear() -> None:
    x, weight, b = _operands(2, 8, 16, torch.float32)
    assert torch.equal(few_rows_linear(x, weight, b, backend=KernelBackend.REFERENCE), F.linear(x, weight, b))
    assert torch.equal(few_rows_linear(x, weight, b), F.linear(x, weight, b))


@pytest.mark.parametrize(
    ("x_shape", "weight_shape", "bias_shape", "message"),
    [
        ((2, 16), (8, 15), None, r"input \(2, 16\) and weight \(8, 15\) do not fit"),
        ((2, 16), (8, 16, 1), None, r"weight \(8, 16, 1\)"),
        ((2, 16), (8, 16), (7,), r"bias \(7,\) must be \(8,\)"),
    ],
)
def test_shapes_that_do_not_fit_raise_naming_them(
    x_shape: tuple[int, ...], weight_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None, message: str
) -> None:
    bias = None if bias_shape is None else torch.zeros(bias_shape)
    with pytest.raises(ValueError, match=message):
        few_rows_linear(torch.zeros(x_shape), torch.zeros(weight_shape), bias)


@_INTERPRETER
def test_mode_routes_nn_linear_and_leaves_other_functions_alone() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24)
    x = torch.randn(3, 1, 40)
    with torch.no_grad():
        expected = torch.relu(F.linear(x, layer.weight, layer.bias)) * 2
        with FewRowsLinearMode(backend=_TRITON):
            out = torch.relu(layer(x)) * 2
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@_INTERPRETER
def test_mode_compiles_to_the_custom_op_in_one_graph() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24)
    graphs: list[str] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        graphs.append(str(graph.graph))
        return graph

    def step(x: torch.Tensor) -> torch.Tensor:
        with FewRowsLinearMode(backend=_TRITON):
            return layer(torch.relu(x))

    x = torch.randn(2, 40)
    with torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, backend=backend)(x)
        torch.testing.assert_close(compiled, step(x))
    assert "d9d_kernels.few_rows_linear" in graphs[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize(
    ("n", "k"), [(1024, 1024), (2048, 1024), (1024, 3072), (6144, 4096), (151936, 1024)], ids=str
)
def test_kernels_at_decode_shapes_on_gpu(rows: int, n: int, k: int) -> None:
    x, weight, b = _operands(rows, n, k, torch.bfloat16, "cuda", bias=n == 1024)
    _assert_rounded_product(few_rows_linear(x, weight, b), x, weight, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_replay_in_a_cuda_graph() -> None:
    x, weight, b = _operands(4, 1024, 1024, torch.bfloat16, "cuda")
    one_row = x[:1].clone()
    eager = (few_rows_linear(x, weight, b), few_rows_linear(one_row, weight, b))  # autotunes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = (few_rows_linear(x, weight, b), few_rows_linear(one_row, weight, b))
    x.copy_(x.flip(0))
    one_row.copy_(x[:1])
    graph.replay()
    torch.testing.assert_close(captured[0], few_rows_linear(x, weight, b), rtol=0, atol=0)
    torch.testing.assert_close(captured[1], few_rows_linear(one_row, weight, b), rtol=0, atol=0)
    assert not torch.equal(captured[0], eager[0])
