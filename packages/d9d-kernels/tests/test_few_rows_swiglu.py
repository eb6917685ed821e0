"""few_rows_swiglu and swiglu_projection: a feed-forward's gate, up and activation in one launch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from d9d.kernels import (
    FewRowsLinearMode,
    KernelBackend,
    few_rows_swiglu,
    swiglu,
    swiglu_projection,
)
from d9d.kernels.layers import SwiGLU

from ._modules import ScaledLinear, compile_capturing_graph

_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)
_TRITON = KernelBackend.TRITON
_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _pair(rows: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", *, bias: bool):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).to(device, dtype)
    gate, up = ((torch.randn(n, k, generator=generator) / k**0.5).to(device, dtype) for _ in range(2))
    biases = (
        (
            torch.randn(n, generator=generator).to(device, dtype),
            torch.randn(n, generator=generator).to(device, dtype),
        )
        if bias
        else (None, None)
    )
    return x, gate, up, biases


def _unfused(x, gate, up, biases) -> torch.Tensor:
    """Each product exact, rounded once to ``x``'s dtype, then the activation in fp32 (the unfused ops)."""
    products = [
        F.linear(x.double(), w.double(), None if b is None else b.double()).to(x.dtype)
        for w, b in zip((gate, up), biases, strict=True)
    ]
    return swiglu(*products, backend=KernelBackend.REFERENCE)


@_INTERPRETER
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_one_launch_equals_the_rounded_products_activated(rows: int, dtype: torch.dtype, bias: bool) -> None:
    # 37 columns: not a multiple of the interpreter's tile, so the last program's columns are masked
    x, gate, up, biases = _pair(rows, 37, 70, dtype, bias=bias)
    out = few_rows_swiglu(x, gate, up, *biases, backend=_TRITON)
    assert out.shape == (rows, 37) and out.dtype == dtype
    # a product a unit in the last place off (fp32 summation order) moves the output by about two
    tolerance = max(3 * torch.finfo(dtype).eps, 1e-5)
    torch.testing.assert_close(out, _unfused(x, gate, up, biases), rtol=tolerance, atol=1e-5)


@_INTERPRETER
def test_inputs_the_launch_cannot_take_go_through_the_group_and_the_activation() -> None:
    x, gate, up, biases = _pair(65, 8, 16, torch.float32, bias=True)  # more rows than a group takes
    out = few_rows_swiglu(x.view(5, 13, 16), gate, up, *biases, backend=_TRITON)
    torch.testing.assert_close(out, _unfused(x, gate, up, biases).view(5, 13, 8))
    with pytest.raises(ValueError, match=r"gate weight \(8, 16\) and up weight \(4, 16\)"):
        few_rows_swiglu(x, gate, up[:4], backend=_TRITON)


def test_without_a_mode_the_modules_and_the_activation_run() -> None:
    torch.manual_seed(0)
    gate, up = nn.Linear(16, 8), ScaledLinear(nn.Linear(16, 8))
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(swiglu_projection(x, gate, up), F.silu(gate(x)) * up(x))


def _compiled_feed_forward(module: SwiGLU, x: torch.Tensor) -> tuple[torch.Tensor, str]:
    def step(x: torch.Tensor) -> torch.Tensor:
        with FewRowsLinearMode(backend=_TRITON, group_projections=True):
            return module(x)

    return compile_capturing_graph(step, x)


@_INTERPRETER
@pytest.mark.parametrize("replaced", [False, True], ids=["plain", "replaced-up"])
def test_a_feed_forward_under_the_mode_takes_one_launch_for_its_input_side(replaced: bool) -> None:
    torch.manual_seed(0)
    module = SwiGLU(40, 24, bias=True)
    x = torch.randn(2, 1, 40)
    with torch.no_grad():
        expected = module(x)
    if replaced:  # a LoRA-like module: the group cannot take it, the modules run
        module.up_proj = ScaledLinear(module.up_proj)  # pyright: ignore[reportAttributeAccessIssue]
        with torch.no_grad():
            expected = module.down_proj(F.silu(module.gate_proj(x)) * module.up_proj(x))
    with torch.no_grad(), FewRowsLinearMode(backend=_TRITON, group_projections=True):
        eager = module(x)
    compiled, graph = _compiled_feed_forward(module, x)
    torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, eager)
    assert graph.count("d9d_kernels.few_rows_swiglu") == (0 if replaced else 1)
    assert "_nn.linear" not in graph  # down (and a replaced module's linear) take the few-rows op


def test_with_gradients_the_feed_forward_keeps_its_training_path() -> None:
    torch.manual_seed(0)
    module = SwiGLU(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None and module.gate_proj.weight.grad is not None


# Qwen3-0.6B and Qwen3-8B feed-forward widths (8B at 64 rows goes to cuBLAS and the activation kernel)
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize(("n", "k"), [(3072, 1024), (12288, 4096)], ids=["0.6b", "8b"])
def test_decode_shapes_on_gpu(rows: int, n: int, k: int) -> None:
    x, gate, up, biases = _pair(rows, n, k, torch.bfloat16, "cuda", bias=False)
    tolerance = 3 * torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(
        few_rows_swiglu(x, gate, up), _unfused(x, gate, up, biases), rtol=tolerance, atol=1e-4
    )


def test_replays_in_a_cuda_graph() -> None:
    x, gate, up, biases = _pair(64, 3072, 1024, torch.bfloat16, "cuda", bias=True)
    eager = few_rows_swiglu(x, gate, up, *biases)  # autotunes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = few_rows_swiglu(x, gate, up, *biases)
    x.copy_(-x)
    graph.replay()
    torch.testing.assert_close(captured, few_rows_swiglu(x, gate, up, *biases), rtol=0, atol=0)
    assert not torch.equal(captured, eager)


for _test in (test_decode_shapes_on_gpu, test_replays_in_a_cuda_graph):
    for _mark in _GPU:
        _mark(_test)
