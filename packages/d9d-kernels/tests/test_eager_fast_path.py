"""Eager calls run the Triton kernels through ``autograd.Function``s, compiled code the custom ops.

Both paths launch the same kernels, so outputs and gradients must be bitwise equal; under
torch.compile the custom ops (opaque to the compiler) must be what lands in the graph.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from d9d.kernels import KernelBackend, apply_rope, rms_norm, swiglu
from d9d.kernels._triton import rms_norm_op, rope_op, swiglu_op

from ._compare import DEVICES

Op = Callable[..., torch.Tensor]
_REGISTERED = (rms_norm_op, rope_op, swiglu_op)  # importing them registers the custom ops
_OPS: Any = torch.ops.d9d_kernels
_TRITON = KernelBackend.TRITON


def _inputs(device: str, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(*shape, device=device, generator=generator) for shape in shapes]


def _angles(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    (freqs,) = _inputs(device, (2, 5, 8))
    angles = torch.cat((freqs, freqs), -1)
    return angles.cos(), angles.sin()


def _outputs_and_grads(op: Op, inputs: list[torch.Tensor], differentiable: int) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_(i < differentiable) for i, t in enumerate(inputs)]
    out = op(*leaves)
    (upstream,) = _inputs(str(out.device), tuple(out.shape))
    grads = torch.autograd.grad(out, leaves[:differentiable], upstream.flip(0))
    return [out, *grads]


# (public op through the eager fast path, the same through the custom op, inputs, leading inputs with grads)
_CASES: dict[str, tuple[Op, Op, Callable[[str], list[torch.Tensor]], int]] = {
    "rms_norm": (
        lambda x, w: rms_norm(x, w, 1e-6, zero_centered_weight=True, backend=_TRITON),
        lambda x, w: _OPS.rms_norm_forward(x, w, 1e-6, True)[0],
        lambda device: _inputs(device, (3, 7, 96), (96,)),
        2,
    ),
    "swiglu": (
        lambda gate, up: swiglu(gate, up, backend=_TRITON),
        _OPS.swiglu_forward,
        lambda device: _inputs(device, (9, 100), (9, 100)),
        2,
    ),
    "apply_rope": (
        lambda x, cos, sin: apply_rope(x, cos, sin, backend=_TRITON),
        lambda x, cos, sin: _OPS.apply_rope(x, cos, sin, False, False),
        lambda device: [*_inputs(device, (2, 5, 3, 16)), *_angles(device)],
        1,
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(_CASES))
def test_eager_path_equals_custom_op(device: str, name: str) -> None:
    eager, custom_op, make_inputs, differentiable = _CASES[name]
    inputs = make_inputs(device)
    eager_results = _outputs_and_grads(eager, inputs, differentiable)
    assert eager_results[0].grad_fn is not None
    assert "d9d_kernels" not in type(eager_results[0].grad_fn).__name__  # not the custom op's autograd
    for got, expected in zip(
        eager_results, _outputs_and_grads(custom_op, inputs, differentiable), strict=True
    ):
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(_CASES))
def test_compiled_graph_calls_the_custom_op(device: str, name: str) -> None:
    eager, _, make_inputs, differentiable = _CASES[name]
    targets: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    compiled = torch.compile(eager, backend=recording_backend, fullgraph=True)
    inputs = make_inputs(device)
    compiled_results = _outputs_and_grads(compiled, inputs, differentiable)
    assert any(target.startswith("d9d_kernels.") for target in targets), targets
    for got, expected in zip(
        compiled_results, _outputs_and_grads(eager, inputs, differentiable), strict=True
    ):
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "op",
    [
        pytest.param(lambda x: rms_norm(x, torch.ones_like(x[0]), backend=_TRITON), id="rms_norm"),
        pytest.param(lambda x: swiglu(x, x * 2, backend=_TRITON), id="swiglu"),
    ],
)
def test_eager_backward_is_once_differentiable(device: str, op: Op) -> None:
    # As through the custom ops, whose backward ops have no autograd: a double backward raises, also
    # where another term of the loss gives the first gradient a graph of its own.
    (x,) = _inputs(device, (4, 32))
    x.requires_grad_(True)
    (dx,) = torch.autograd.grad(op(x).square().sum() + x.pow(3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        dx.sum().backward()
