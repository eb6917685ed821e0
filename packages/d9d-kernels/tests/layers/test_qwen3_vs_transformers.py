"""Qwen3 attention, MLP and RMSNorm against Hugging Face modules with copied weights (tiny configs)."""

from typing import Any

import pytest
import torch
from torch import nn

from d9d.kernels.layers import EagerAttentionBackend, GroupedQueryAttention, RMSNorm, RotaryEmbedding, SwiGLU

transformers = pytest.importorskip("transformers")
qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")


def _config(num_heads: int, num_kv_heads: int) -> Any:
    config = transformers.Qwen3Config(
        hidden_size=48,
        intermediate_size=80,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config._attn_implementation = "eager"
    return config


def _assert_grads_close(ours: nn.Module, theirs: nn.Module, **tolerance: float) -> None:
    their_params = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(
            param.grad, their_params[name].grad, **tolerance, msg=lambda m, n=name: f"{n}: {m}"
        )


def _causal_additive_mask(seq: int) -> torch.Tensor:
    return torch.full((seq, seq), float("-inf")).triu(1)[None, None]


# (num_heads, num_kv_heads): GQA, MHA, MQA
HEADS = [(4, 2), (4, 4), (4, 1)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_attention_matches_qwen3(num_heads: int, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    config = _config(num_heads, num_kv_heads)
    theirs = qwen3.Qwen3Attention(config, layer_idx=0)
    for param in theirs.parameters():  # HF leaves norms at one: randomize so q/k norm is exercised
        nn.init.normal_(param, std=0.2)
    ours = GroupedQueryAttention(
        48, num_heads, num_kv_heads, head_dim=16, qk_norm=True, attention_backend=EagerAttentionBackend()
    )
    ours.load_state_dict(theirs.state_dict())
    hidden = torch.randn(2, 10, 48)
    hidden_ours = hidden.clone().requires_grad_()
    hidden_theirs = hidden.clone().requires_grad_()
    position_ids = torch.arange(10).expand(2, 10)
    cos, sin = RotaryEmbedding(16)(position_ids)
    hf_cos, hf_sin = qwen3.Qwen3RotaryEmbedding(config)(hidden, position_ids)
    torch.testing.assert_close(cos, hf_cos)

    out = ours(hidden_ours, (cos, sin))
    expected, _ = theirs(hidden_theirs, (hf_cos, hf_sin), attention_mask=_causal_additive_mask(10))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(hidden_ours.grad, hidden_theirs.grad, rtol=1e-5, atol=1e-5)
    _assert_grads_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_mlp_matches_qwen3() -> None:
    torch.manual_seed(0)
    theirs = qwen3.Qwen3MLP(_config(4, 2))
    ours = SwiGLU(48, 80)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 48)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = ours(x_ours), theirs(x_theirs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-6)
    _assert_grads_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_qwen3() -> None:
    torch.manual_seed(0)
    theirs = qwen3.Qwen3RMSNorm(48, eps=1e-6)
    nn.init.normal_(theirs.weight)
    ours = RMSNorm(48, 1e-6)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 48)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = ours(x_ours), theirs(x_theirs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-5)
