"""SwiGLU's activation is recomputed in backward, not kept: same gradients, less memory."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from d9d.kernels import swiglu
from d9d.kernels.layers import SwiGLU
from d9d.kernels.layers._recomputed_activation import recompute_when_saved


def _plain_forward(module: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(swiglu(module.gate_proj(x), module.up_proj(x)))


def test_the_activation_is_freed_after_forward_and_recomputed_in_backward() -> None:
    gate = torch.randn(6, 16, requires_grad=True)
    up = torch.randn(6, 16, requires_grad=True)
    linear = nn.Linear(16, 8)
    calls: list[int] = []

    def again() -> torch.Tensor:
        calls.append(1)
        return swiglu(gate.detach(), up.detach())

    activation = swiglu(gate, up)
    with recompute_when_saved(activation, again):
        out = linear(activation)
    alive = weakref.ref(activation)
    del activation
    gc.collect()
    assert alive() is None  # nothing saved it for backward
    out.square().sum().backward()
    assert calls == [1]

    expected_gate, expected_up = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    reference = copy.deepcopy(linear)
    reference.zero_grad()
    reference(swiglu(expected_gate, expected_up)).square().sum().backward()
    assert linear.weight.grad is not None and reference.weight.grad is not None
    torch.testing.assert_close(gate.grad, expected_gate.grad, rtol=0, atol=0)
    torch.testing.assert_close(up.grad, expected_up.grad, rtol=0, atol=0)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_swiglu_gradients_equal_the_plain_composition(checkpointed: bool) -> None:
    torch.manual_seed(0)
    module = SwiGLU(32, 48)
    plain = copy.deepcopy(module)
    x = torch.randn(2, 5, 32, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    out = checkpoint(module, x, use_reentrant=False) if checkpointed else module(x)
    assert isinstance(out, torch.Tensor)
    out.sin().sum().backward()
    _plain_forward(plain, x_plain).sin().sum().backward()
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=0, atol=0)
    for (name, p), q in zip(module.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_other_saved_tensors_are_left_alone() -> None:
    activation = torch.randn(4, 4, requires_grad=True)
    other = torch.randn(4, 4, requires_grad=True)
    with recompute_when_saved(activation, lambda: pytest.fail("recomputed a tensor it does not own")):
        out = other * other.exp()  # saves `other` and its exp, neither is the activation
    out.sum().backward()
    torch.testing.assert_close(other.grad, (other * other.exp() + other.exp()).detach())
