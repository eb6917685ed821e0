"""MoELayer with a biased router, biased experts and the clamped SwiGLU against transformers' GptOssMLP."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from d9d.kernels.layers import ClampedSwiGLU, GroupedSwiGLUExperts, MoELayer, clamped_swiglu


def _hf_mlp(limit: float) -> Any:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(
        hidden_size=16, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=limit
    )
    torch.manual_seed(0)
    mlp = GptOssMLP(config)
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.normal_(std=0.5)  # wide enough that the clamps bite
    return mlp


def _ours(hf: Any, limit: float) -> MoELayer:
    layer = MoELayer(
        16,
        4,
        2,
        12,
        router_bias=True,
        expert_projection_bias=True,
        expert_activation=ClampedSwiGLU(alpha=1.702, limit=limit),
    )
    experts = hf.experts
    with torch.no_grad():
        layer.router.weight.copy_(hf.router.weight)
        assert layer.router.bias is not None
        layer.router.bias.copy_(hf.router.bias)
        layer.experts.gate_proj.copy_(experts.gate_up_proj[..., ::2])
        layer.experts.up_proj.copy_(experts.gate_up_proj[..., 1::2])
        layer.experts.down_proj.copy_(experts.down_proj)
        for ours, theirs in (
            (layer.experts.gate_proj_bias, experts.gate_up_proj_bias[..., ::2]),
            (layer.experts.up_proj_bias, experts.gate_up_proj_bias[..., 1::2]),
            (layer.experts.down_proj_bias, experts.down_proj_bias),
        ):
            assert ours is not None
            ours.copy_(theirs)
    return layer


@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_moe_layer_equals_gpt_oss_mlp_outputs_and_gradients(limit: float) -> None:
    hf = _hf_mlp(limit)
    ours = _ours(hf, limit)
    hidden = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    expected, _ = hf(hidden)
    got = ours(hidden)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    (expected * weight).sum().backward()
    (got * weight).sum().backward()
    experts, grads = hf.experts, ours.experts
    pairs = [
        (ours.router.weight.grad, hf.router.weight.grad),
        (ours.router.bias.grad if ours.router.bias is not None else None, hf.router.bias.grad),
        (grads.gate_proj.grad, experts.gate_up_proj.grad[..., ::2]),
        (grads.up_proj.grad, experts.gate_up_proj.grad[..., 1::2]),
        (grads.down_proj.grad, experts.down_proj.grad),
        (
            grads.up_proj_bias.grad if grads.up_proj_bias is not None else None,
            experts.gate_up_proj_bias.grad[..., 1::2],
        ),
        (
            grads.down_proj_bias.grad if grads.down_proj_bias is not None else None,
            experts.down_proj_bias.grad,
        ),
    ]
    for mine, theirs in pairs:
        assert mine is not None
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_clamped_swiglu_clamps_gate_above_and_up_on_both_sides() -> None:
    gate = torch.tensor([-9.0, -1.0, 0.5, 9.0], requires_grad=True)
    up = torch.tensor([-9.0, 0.3, 2.0, 9.0], requires_grad=True)
    out = clamped_swiglu(gate, up, alpha=1.702, limit=7.0)
    g = torch.tensor([-9.0, -1.0, 0.5, 7.0])  # the gate is not clamped from below
    u = torch.tensor([-7.0, 0.3, 2.0, 7.0])
    torch.testing.assert_close(out, (u + 1) * g * torch.sigmoid(1.702 * g))
    out.sum().backward()
    assert gate.grad is not None and up.grad is not None
    assert gate.grad[3] == 0 and up.grad[0] == 0 and up.grad[3] == 0  # nothing flows past a clamp


def test_expert_biases_follow_uneven_groups_and_start_at_zero() -> None:
    torch.manual_seed(0)
    experts = GroupedSwiGLUExperts(3, 8, 6, bias=True)
    assert experts.down_proj_bias is not None and experts.down_proj_bias.abs().max() == 0
    gate_bias, up_bias, down_bias = experts.gate_proj_bias, experts.up_proj_bias, experts.down_proj_bias
    assert gate_bias is not None and up_bias is not None and down_bias is not None
    with torch.no_grad():
        for bias in (gate_bias, up_bias, down_bias):
            bias.normal_()
    counts = torch.tensor([3, 0, 2])
    tokens = torch.randn(5, 8)
    got = experts(tokens, counts)
    expected = []
    for row, e in zip(tokens, [0, 0, 0, 2, 2], strict=True):
        gate = row @ experts.gate_proj[e] + gate_bias[e]
        up = row @ experts.up_proj[e] + up_bias[e]
        expected.append(torch.nn.functional.silu(gate) * up @ experts.down_proj[e] + down_bias[e])
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=1e-5)
