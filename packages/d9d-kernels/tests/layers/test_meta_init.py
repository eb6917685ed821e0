"""Every layer builds on the meta device and gets finite, sensibly scaled weights from reset_parameters()."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

from d9d.kernels.layers import (
    ClassificationHead,
    EagerAttentionBackend,
    EmbeddingHead,
    GroupedQueryAttention,
    GroupedSwiGLUExperts,
    LanguageModelHead,
    MoELayer,
    RMSNorm,
    RotaryApplicator,
    RotaryEmbedding,
    SwiGLU,
    TokenEmbedding,
    TopKRouter,
)

# (name, factory): one entry per public layer
LAYERS: list[tuple[str, Callable[[], nn.Module]]] = [
    ("rms_norm", lambda: RMSNorm(64)),
    ("rms_norm_zero_centered", lambda: RMSNorm(64, zero_centered_weight=True)),
    ("swiglu", lambda: SwiGLU(64, 96)),
    ("token_embedding", lambda: TokenEmbedding(100, 64)),
    ("rotary_embedding", lambda: RotaryEmbedding(16)),
    ("rotary_applicator", RotaryApplicator),
    (
        "attention",
        lambda: GroupedQueryAttention(
            64, 4, 2, qk_norm=True, bias=True, attention_backend=EagerAttentionBackend()
        ),
    ),
    ("router", lambda: TopKRouter(64, 8, 2, expert_bias=True)),
    ("experts", lambda: GroupedSwiGLUExperts(8, 64, 32)),
    ("moe", lambda: MoELayer(64, 8, 2, 32, shared_expert_intermediate_size=48, expert_bias=True)),
    ("lm_head", lambda: LanguageModelHead(64, 100)),
    ("classification_head", lambda: ClassificationHead(64, 3)),
    ("embedding_head", lambda: EmbeddingHead(64, output_size=32)),
]


@pytest.mark.parametrize(("name", "factory"), LAYERS, ids=[name for name, _ in LAYERS])
def test_meta_build_then_reset_gives_sane_weights(name: str, factory: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    eager = factory()
    with torch.device("meta"):
        layer = factory()
    assert all(t.is_meta for t in layer.state_dict().values())
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    for tensor_name, value in [*layer.named_parameters(), *layer.named_buffers()]:
        tensor = value.detach()
        assert torch.isfinite(tensor).all(), f"{name}.{tensor_name} is not finite"
        reference = dict([*eager.named_parameters(), *eager.named_buffers()])[tensor_name]
        if tensor.ndim >= 2:  # random matrices: mean ~0, std as configured (0.02), truncated at 3 std
            assert abs(float(tensor.mean())) < 0.005, f"{name}.{tensor_name}"
            assert 0.015 < float(tensor.std()) < 0.025, f"{name}.{tensor_name}"
            assert float(tensor.abs().max()) <= 0.06 + 1e-6, f"{name}.{tensor_name}"
        else:  # norms, biases, frequencies, counters: deterministic, equal to a CPU-built layer
            torch.testing.assert_close(tensor, reference, rtol=0, atol=0, msg=f"{name}.{tensor_name}")
