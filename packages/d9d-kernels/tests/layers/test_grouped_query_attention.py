"""GroupedQueryAttention: packed documents and heads derived from local (sharded) projections."""

import pytest
import torch
from torch import nn

from d9d.kernels.layers import (
    EagerAttentionBackend,
    GroupedQueryAttention,
    RotaryEmbedding,
    SdpaAttentionBackend,
    position_ids_from_document_ids,
)


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


def test_all_heads_qk_norm_normalizes_the_whole_projection() -> None:
    # one RMS over all heads' channels (a weight per channel), then the heads, then RoPE
    torch.manual_seed(0)
    layer = GroupedQueryAttention(
        32, 4, 2, qk_norm=True, qk_norm_scope="all_heads", attention_backend=EagerAttentionBackend()
    )
    assert layer.q_norm is not None and layer.k_norm is not None
    assert layer.q_norm.weight.shape == (32,) and layer.k_norm.weight.shape == (16,)
    with torch.no_grad():
        layer.q_norm.weight.uniform_(0.5, 1.5)
        layer.k_norm.weight.uniform_(0.5, 1.5)
    hidden = torch.randn(2, 5, 32)
    cos_sin = RotaryEmbedding(8)(torch.arange(5).expand(2, 5))

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    query = rms(layer.q_proj(hidden), layer.q_norm.weight).view(2, 5, 4, 8)
    key = rms(layer.k_proj(hidden), layer.k_norm.weight).view(2, 5, 2, 8)
    value = layer.v_proj(hidden).view(2, 5, 2, 8)
    query, key = layer.rotary(query, *cos_sin), layer.rotary(key, *cos_sin)
    attended = layer.attention_backend.attend(
        query, key, value, causal=True, softmax_scale=8**-0.5, sliding_window=None, document_ids=None
    )
    expected = layer.o_proj(attended.reshape(2, 5, 32))
    torch.testing.assert_close(layer(hidden, cos_sin), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("zero_centered", [False, True], ids=["qwen3", "zero-centered"])
def test_inference_takes_one_qk_norm_rope_launch_and_gives_the_training_path(zero_centered: bool) -> None:
    """Without gradients the per-head norms and rotations are one ``qk_norm_rope`` launch; with
    them the separate ops run. Qwen3-0.6B's heads in bf16: the two outputs agree."""
    torch.manual_seed(0)
    layer = GroupedQueryAttention(
        1024, 16, 8, head_dim=128, qk_norm=True, qk_norm_zero_centered=zero_centered,
        attention_backend=SdpaAttentionBackend(),
    ).to("cuda", torch.bfloat16)  # fmt: skip
    with torch.no_grad():
        for norm in (layer.q_norm, layer.k_norm):
            assert norm is not None
            norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    hidden = torch.randn(2, 9, 1024, device="cuda", dtype=torch.bfloat16)
    cos_sin = RotaryEmbedding(128).to("cuda")(
        torch.arange(9, device="cuda").expand(2, 9), dtype=torch.bfloat16
    )
    with torch.no_grad():
        fused = layer(hidden, cos_sin)
    separate = layer(hidden.requires_grad_(), cos_sin)
    torch.testing.assert_close(fused, separate.detach(), rtol=2e-2, atol=2e-2)
