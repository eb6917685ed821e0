"""few_rows_linear_group and shared_input_linear: one launch for one input's projections."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from d9d.kernels import FewRowsLinearMode, KernelBackend, few_rows_linear_group, shared_input_linear

from ._modules import ScaledLinear, compile_capturing_graph

_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)
_TRITON = KernelBackend.TRITON


def _group(rows: int, widths: list[int], k: int, dtype: torch.dtype, device: str = "cpu", *, bias: bool):
    generator = torch.Generator().manual_seed(rows * 1000 + sum(widths) + k)
    x = torch.randn(rows, k, generator=generator).to(device, dtype)
    weights = [(torch.randn(n, k, generator=generator) / k**0.5).to(device, dtype) for n in widths]
    biases = [torch.randn(n, generator=generator).to(device, dtype) for n in widths] if bias else None
    return x, weights, biases


def _assert_rounded_products(outs, x, weights, biases) -> None:
    """Each output is its float64 product rounded once (plus the fp32 summation's error)."""
    assert len(outs) == len(weights)
    for index, (out, weight) in enumerate(zip(outs, weights, strict=True)):
        bias = None if biases is None else biases[index]
        exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        assert out.dtype == x.dtype and out.shape == exact.shape and out.is_contiguous()
        tolerance = torch.finfo(x.dtype).eps * exact.abs() + 1e-5 * (
            x.double().abs() @ weight.double().abs().T + 1
        )
        excess = (out.double() - exact).abs() - tolerance
        assert excess.max().item() <= 0, (
            f"product {index} off by {(out.double() - exact).abs().max().item():.3g}"
        )


@_INTERPRETER
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("widths", [[37, 19, 19], [24, 24]], ids=["qkv", "gate-up"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_one_launch_rounds_each_exact_product_once(
    rows: int, widths: list[int], dtype: torch.dtype, bias: bool
) -> None:
    # widths not multiples of the interpreter's tiles: a program's columns straddle no two weights
    x, weights, biases = _group(rows, widths, 70, dtype, bias=bias)
    _assert_rounded_products(few_rows_linear_group(x, weights, biases, backend=_TRITON), x, weights, biases)


@_INTERPRETER
@pytest.mark.parametrize("rows", [17, 64])
def test_one_launch_takes_up_to_64_rows(rows: int) -> None:
    """Past the single product's 16 rows the group still takes one launch (32- and 64-row tiles)."""
    x, weights, biases = _group(rows, [37, 19, 19], 40, torch.bfloat16, bias=True)
    _assert_rounded_products(few_rows_linear_group(x, weights, biases, backend=_TRITON), x, weights, biases)


@pytest.mark.parametrize(
    ("rows", "widths", "k", "one_launch"),
    [
        (16, [12288, 12288], 4096, True),  # up to 16 rows every group takes the kernel
        (64, [2048, 1024, 1024], 1024, True),  # Qwen3-0.6B q/k/v: 2.02x cuBLAS at 64 rows on the H200
        (64, [4096, 1024, 1024], 4096, True),  # Qwen3-8B q/k/v: 1.24x
        (64, [12288, 12288], 4096, False),  # Qwen3-8B gate/up: 0.82x, cuBLAS keeps it
        (65, [8, 8], 16, False),
    ],
)
def test_wide_groups_past_16_rows_stay_on_cublas(
    rows: int, widths: list[int], k: int, one_launch: bool
) -> None:
    from d9d.kernels._triton.few_rows_linear_op import group_takes_one_launch

    weights = [torch.empty(n, k, device="meta") for n in widths]
    assert group_takes_one_launch(rows, weights) is one_launch


@_INTERPRETER
def test_groups_the_launch_cannot_take_go_product_by_product() -> None:
    x, weights, biases = _group(65, [8, 8], 16, torch.float32, bias=True)  # more rows than the kernel takes
    outs = few_rows_linear_group(x.view(65, 1, 16), weights, biases, backend=_TRITON)
    for out, weight, bias in zip(outs, weights, biases or [], strict=True):
        assert torch.equal(out, F.linear(x.view(65, 1, 16), weight, bias))
    x, weights, _ = _group(2, [8, 8], 16, torch.float32, bias=False)
    mixed = [torch.ones(8), None]  # a bias for one weight only: two launches, the same products
    outs = few_rows_linear_group(x, weights, mixed, backend=_TRITON)
    torch.testing.assert_close(outs[0], F.linear(x, weights[0], mixed[0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], F.linear(x, weights[1]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="1 biases for 2 weights"):
        few_rows_linear_group(x, weights, [None])


def test_without_a_mode_the_modules_run_themselves() -> None:
    torch.manual_seed(0)
    calls: list[str] = []
    first, second = nn.Linear(16, 8), nn.Linear(16, 4)
    second.register_forward_hook(lambda *_: calls.append("hook"))
    x = torch.randn(3, 16)
    out = shared_input_linear(x, (first, second))
    assert calls == ["hook"]
    assert torch.equal(out[0], first(x)) and torch.equal(out[1], second(x))


@_INTERPRETER
def test_mode_groups_plain_linears_and_calls_the_others() -> None:
    torch.manual_seed(0)
    q, k, v = nn.Linear(40, 24), nn.Linear(40, 8), nn.Linear(40, 8)
    x = torch.randn(2, 1, 40)
    calls: list[str] = []
    with torch.no_grad():
        expected = tuple(linear(x) for linear in (q, k, v))
        with FewRowsLinearMode(backend=_TRITON, group_projections=True):
            grouped = shared_input_linear(x, (q, k, v))
            replaced = shared_input_linear(x, (q, ScaledLinear(k)))
            k.register_forward_pre_hook(lambda *_: calls.append("pre-hook"))
            hooked = shared_input_linear(x, (q, k, v))
    for out, reference in zip(grouped, expected, strict=True):
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(replaced[1], 2 * expected[1], rtol=1e-5, atol=1e-5)
    assert calls == ["pre-hook"]
    torch.testing.assert_close(hooked[1], expected[1], rtol=1e-5, atol=1e-5)


def _compile_gate_up(linears: tuple[nn.Module, nn.Module], *, group_projections: bool):
    """``gate * up`` of one input under the mode, compiled in one graph: (compiled, eager, graph text)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        with FewRowsLinearMode(backend=_TRITON, group_projections=group_projections):
            a, b = shared_input_linear(torch.relu(x), linears)
            return a * b

    x = torch.randn(2, 40)
    compiled, graph = compile_capturing_graph(step, x)
    with torch.no_grad():
        return compiled, step(x), graph, x


@_INTERPRETER
def test_mode_compiles_a_group_to_one_custom_op() -> None:
    torch.manual_seed(0)
    gate, up = nn.Linear(40, 24, bias=False), nn.Linear(40, 24, bias=False)
    compiled, eager, graph, _ = _compile_gate_up((gate, up), group_projections=True)
    torch.testing.assert_close(compiled, eager)
    assert graph.count("d9d_kernels.few_rows_linear_group") == 1
    assert "d9d_kernels.few_rows_linear.default" not in graph


# Qwen3-0.6B q/k/v (with biases) and gate/up, Qwen3-8B q/k/v: each shape autotunes both kernels
_DECODE_GROUPS = [[2048, 1024, 1024], [3072, 3072], [4096, 1024, 1024]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("widths", _DECODE_GROUPS, ids=str)
def test_groups_at_decode_shapes_on_gpu(rows: int, widths: list[int]) -> None:
    k = 4096 if widths[0] == 4096 else 1024
    x, weights, biases = _group(rows, widths, k, torch.bfloat16, "cuda", bias=widths[0] == 2048)
    _assert_rounded_products(few_rows_linear_group(x, weights, biases), x, weights, biases)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_group_replays_in_a_cuda_graph() -> None:
    x, weights, biases = _group(1, [2048, 1024, 1024], 1024, torch.bfloat16, "cuda", bias=True)
    eager = few_rows_linear_group(x, weights, biases)  # autotunes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = few_rows_linear_group(x, weights, biases)
    x.copy_(-x)
    graph.replay()
    for out, again, before in zip(captured, few_rows_linear_group(x, weights, biases), eager, strict=True):
        torch.testing.assert_close(out, again, rtol=0, atol=0)
        assert not torch.equal(out, before)


@_INTERPRETER
@pytest.mark.parametrize("group_projections", [False, True], ids=["per-linear", "grouped"])
def test_linears_the_mode_does_not_group_still_take_the_kernel(group_projections: bool) -> None:
    """A mode is off while it handles a call: the modules it hands back must run with it on again."""
    torch.manual_seed(0)
    gate, up = nn.Linear(40, 24, bias=False), nn.Linear(40, 24, bias=False)
    linears = (gate, up) if not group_projections else (gate, ScaledLinear(up))  # grouped: a replaced module
    compiled, eager, graph, x = _compile_gate_up(linears, group_projections=group_projections)
    torch.testing.assert_close(compiled, eager)
    with torch.no_grad():
        torch.testing.assert_close(compiled, gate(x.relu()) * linears[1](x.relu()), rtol=1e-5, atol=1e-5)
    assert graph.count("d9d_kernels.few_rows_linear.default") == 2
    assert "few_rows_linear_group" not in graph and "_nn.linear" not in graph
