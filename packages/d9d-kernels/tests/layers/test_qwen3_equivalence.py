"""Qwen3 attention, MLP and RMSNorm against Hugging Face modules with copied weights (tiny configs)."""

import pytest
import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from d9d.kernels.layers import (
    EagerAttentionBackend,
    GroupedQueryAttention,
    RMSNorm,
    RotaryEmbedding,
    SdpaAttentionBackend,
    SwiGLU,
    position_ids_from_document_ids,
)


def _config(num_heads: int, num_kv_heads: int) -> Qwen3Config:
    config = Qwen3Config(
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
    theirs = Qwen3Attention(config, layer_idx=0)
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
    hf_cos, hf_sin = Qwen3RotaryEmbedding(config)(hidden, position_ids)
    torch.testing.assert_close(cos, hf_cos)

    out = ours(hidden_ours, (cos, sin))
    expected, _ = theirs(hidden_theirs, (hf_cos, hf_sin), attention_mask=_causal_additive_mask(10))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(hidden_ours.grad, hidden_theirs.grad, rtol=1e-5, atol=1e-5)
    _assert_grads_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_packed_attention_layer_equals_per_document() -> None:
    torch.manual_seed(0)
    layer = GroupedQueryAttention(32, 4, 2, qk_norm=True, attention_backend=SdpaAttentionBackend())
    rotary = RotaryEmbedding(8)
    lengths = [5, 3, 6]
    documents = [torch.randn(1, n, 32) for n in lengths]
    packed_hidden = torch.cat(documents, dim=1)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    packed_positions = position_ids_from_document_ids(document_ids)
    packed = layer(packed_hidden, rotary(packed_positions), document_ids=document_ids)
    start = 0
    for n, document in zip(lengths, documents, strict=True):
        alone = layer(document, rotary(torch.arange(n).unsqueeze(0)))
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-6)
        start += n


def test_heads_come_from_local_projection_shapes() -> None:
    # Simulates tensor parallelism from outside: each shard keeps half of the q/kv heads (columns of
    # q/k/v, rows of o); the shards' outputs sum to the full layer's output.
    torch.manual_seed(0)
    full = GroupedQueryAttention(32, 4, 2, qk_norm=True, attention_backend=EagerAttentionBackend())
    hidden = torch.randn(2, 7, 32)
    cos_sin = RotaryEmbedding(8)(torch.arange(7).expand(2, 7))
    total = torch.zeros(2, 7, 32)
    for shard in range(2):
        part = GroupedQueryAttention(32, 4, 2, qk_norm=True, attention_backend=EagerAttentionBackend())
        state = full.state_dict()
        q_rows = slice(shard * 16, (shard + 1) * 16)
        kv_rows = slice(shard * 8, (shard + 1) * 8)
        part.q_proj.weight = nn.Parameter(state["q_proj.weight"][q_rows])
        part.k_proj.weight = nn.Parameter(state["k_proj.weight"][kv_rows])
        part.v_proj.weight = nn.Parameter(state["v_proj.weight"][kv_rows])
        part.o_proj.weight = nn.Parameter(state["o_proj.weight"][:, q_rows])
        assert part.q_norm is not None and part.k_norm is not None
        assert full.q_norm is not None and full.k_norm is not None
        part.q_norm.load_state_dict(full.q_norm.state_dict())
        part.k_norm.load_state_dict(full.k_norm.state_dict())
        total += part(hidden, cos_sin)
    torch.testing.assert_close(total, full(hidden, cos_sin), rtol=1e-5, atol=1e-6)


def test_mlp_matches_qwen3() -> None:
    torch.manual_seed(0)
    theirs = Qwen3MLP(_config(4, 2))
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
    theirs = Qwen3RMSNorm(48, eps=1e-6)
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


def test_zero_centered_rms_norm_scales_by_one_plus_weight() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(8, zero_centered_weight=True)
    with torch.no_grad():
        norm.weight.normal_()
    plain = RMSNorm(8)
    with torch.no_grad():
        plain.weight.copy_(1 + norm.weight)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), plain(x))
