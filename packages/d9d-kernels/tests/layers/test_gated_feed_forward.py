"""The gated feed-forward's activation switch, and zero-centered q/k norms."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from d9d.kernels.layers import GroupedQueryAttention, RotaryEmbedding, SwiGLU


def test_gelu_tanh_gates_with_the_tanh_approximated_gelu_forward_and_backward() -> None:
    torch.manual_seed(0)
    mlp = SwiGLU(8, 12, activation="gelu_tanh")
    x = torch.randn(2, 3, 8, requires_grad=True)
    out = mlp(x)
    expected = mlp.down_proj(F.gelu(mlp.gate_proj(x), approximate="tanh") * mlp.up_proj(x))
    torch.testing.assert_close(out, expected)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
    torch.testing.assert_close(grad, expected_grad)
    silu = SwiGLU(8, 12)
    silu.load_state_dict(mlp.state_dict())
    assert not torch.allclose(silu(x), out)  # the default stays SiLU


def test_zero_centered_qk_norms_scale_by_one_plus_weight() -> None:
    torch.manual_seed(0)
    centered = GroupedQueryAttention(
        16, 2, 1, qk_norm=True, qk_norm_zero_centered=True, attention_backend="eager"
    )
    plain = GroupedQueryAttention(16, 2, 1, qk_norm=True, attention_backend="eager")
    assert centered.q_norm is not None and centered.k_norm is not None
    with torch.no_grad():
        centered.q_norm.weight.normal_()
        centered.k_norm.weight.normal_()
    state = centered.state_dict()
    plain.load_state_dict({k: v + 1 if k.endswith("_norm.weight") else v for k, v in state.items()})
    x = torch.randn(1, 5, 16)
    tables = RotaryEmbedding(8)(torch.arange(5)[None], dtype=x.dtype)
    torch.testing.assert_close(centered(x, tables), plain(x, tables))
