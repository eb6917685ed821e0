"""Rotary scaling variants against Hugging Face's Llama rotary embedding (frequencies, outputs, gradients)."""

import math
from typing import Any

import pytest
import torch

from d9d.kernels.layers import (
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeScaling,
    NtkRopeScaling,
    RopeScaling,
    RotaryApplicator,
    RotaryEmbedding,
    YarnRopeScaling,
    compute_rope_frequencies,
)

transformers = pytest.importorskip("transformers")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")

HEAD_DIM = 32
THETA = 50000.0
MAX_POSITIONS = 64
SHORT_FACTOR = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
LONG_FACTOR = [1.5 + 0.4 * i for i in range(HEAD_DIM // 2)]
LONGROPE = LongRopeScaling(
    short_factor=tuple(SHORT_FACTOR),
    long_factor=tuple(LONG_FACTOR),
    original_max_position_embeddings=16,
    attention_factor=math.sqrt(1 + math.log(MAX_POSITIONS / 16) / math.log(16)),  # Hugging Face's default
)
HF_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": SHORT_FACTOR,
    "long_factor": LONG_FACTOR,
    "original_max_position_embeddings": 16,
}

# (our scaling, Hugging Face rope_parameters)
SCALING_CASES: list[tuple[RopeScaling | None, dict[str, Any]]] = [
    # plain RoPE
    (None, {"rope_type": "default"}),
    # position interpolation
    (LinearRopeScaling(factor=4.0), {"rope_type": "linear", "factor": 4.0}),
    # dynamic NTK-aware (a fresh HF module computes it for max_position_embeddings)
    (
        NtkRopeScaling(factor=2.0, max_position_embeddings=MAX_POSITIONS),
        {"rope_type": "dynamic", "factor": 2.0},
    ),
    # YaRN with defaults (attention factor derived from factor)
    (
        YarnRopeScaling(factor=4.0, original_max_position_embeddings=16),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ),
    # YaRN, DeepSeek-style mscales, custom betas, no truncation
    (
        YarnRopeScaling(
            factor=8.0,
            original_max_position_embeddings=32,
            beta_fast=16.0,
            beta_slow=2.0,
            mscale=1.0,
            mscale_all_dim=0.5,
            truncate=False,
        ),
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "truncate": False,
        },
    ),
    # Llama 3.1 (small original context so all three frequency bands occur at head_dim 32)
    (
        Llama3RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        ),
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # LongRoPE (Phi-3 128k): the short factors at build, the long ones past the original context
    (LONGROPE, HF_LONGROPE),
]


def _hf_rotary(rope_parameters: dict[str, Any]) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_theta": THETA, **rope_parameters},
    )
    return llama.LlamaRotaryEmbedding(config)


@pytest.mark.parametrize(("scaling", "hf_parameters"), SCALING_CASES)
def test_frequencies_match_hugging_face(scaling: RopeScaling | None, hf_parameters: dict[str, Any]) -> None:
    hf = _hf_rotary(hf_parameters)
    frequencies, attention_factor = compute_rope_frequencies(HEAD_DIM, theta=THETA, scaling=scaling)
    torch.testing.assert_close(frequencies, hf.inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(hf.attention_scaling, rel=1e-12)


@pytest.mark.parametrize(("scaling", "hf_parameters"), SCALING_CASES)
def test_rotated_queries_and_gradients_match_hugging_face(
    scaling: RopeScaling | None, hf_parameters: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    hf = _hf_rotary(hf_parameters)
    ours = RotaryEmbedding(HEAD_DIM, theta=THETA, scaling=scaling)
    position_ids = torch.arange(48).reshape(2, 24)  # second row starts past the first
    q = torch.randn(2, 24, 4, HEAD_DIM, requires_grad=True)
    k = torch.randn(2, 24, 2, HEAD_DIM, requires_grad=True)
    q_ref = q.detach().clone().requires_grad_()
    k_ref = k.detach().clone().requires_grad_()

    cos, sin = ours(position_ids)
    hf_cos, hf_sin = hf(q_ref, position_ids)
    torch.testing.assert_close(cos, hf_cos, rtol=1e-5, atol=1e-6)
    applicator = RotaryApplicator("half")
    q_out, k_out = applicator(q, cos, sin), applicator(k, cos, sin)
    q_hf, k_hf = llama.apply_rotary_pos_emb(q_ref, k_ref, hf_cos, hf_sin, unsqueeze_dim=2)
    torch.testing.assert_close(q_out, q_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_hf, rtol=1e-5, atol=1e-5)
    upstream_q, upstream_k = torch.randn_like(q_out), torch.randn_like(k_out)
    ((q_out * upstream_q).sum() + (k_out * upstream_k).sum()).backward()
    ((q_hf * upstream_q).sum() + (k_hf * upstream_k).sum()).backward()
    assert q.grad is not None and k.grad is not None
    torch.testing.assert_close(q.grad, q_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad, k_ref.grad, rtol=1e-5, atol=1e-5)


def test_dynamic_ntk_recomputes_for_long_positions_like_hugging_face() -> None:
    scaling = NtkRopeScaling(factor=2.0, max_position_embeddings=MAX_POSITIONS)
    hf = _hf_rotary({"rope_type": "dynamic", "factor": 2.0})
    ours = RotaryEmbedding(HEAD_DIM, theta=THETA, scaling=scaling)
    position_ids = torch.arange(200).unsqueeze(0)  # longer than max_position_embeddings
    x = torch.zeros(1)
    hf_cos, hf_sin = hf(x, position_ids)
    cos, sin = ours(position_ids)
    torch.testing.assert_close(cos, hf_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin, rtol=1e-5, atol=1e-5)


def test_longrope_picks_short_or_long_factors_per_forward_like_hugging_face() -> None:
    """Positions within the original context, past it, then within it again (the same modules)."""
    hf = _hf_rotary(HF_LONGROPE)
    ours = RotaryEmbedding(HEAD_DIM, theta=THETA, scaling=LONGROPE)
    x = torch.zeros(1)
    for positions in (torch.arange(12)[None], torch.arange(40).reshape(2, 20), torch.arange(16)[None]):
        hf_cos, hf_sin = hf(x, positions)
        cos, sin = ours(positions)
        torch.testing.assert_close(cos, hf_cos, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, hf_sin, rtol=1e-6, atol=1e-6)
    short, _ = compute_rope_frequencies(HEAD_DIM, theta=THETA, scaling=LONGROPE, sequence_length=16)
    long, _ = compute_rope_frequencies(HEAD_DIM, theta=THETA, scaling=LONGROPE, sequence_length=17)
    assert not torch.equal(short, long)


def test_longrope_factors_of_the_wrong_length_are_refused() -> None:
    scaling = LongRopeScaling(
        short_factor=(1.0,) * 3, long_factor=(1.0,) * 3, original_max_position_embeddings=16
    )
    with pytest.raises(
        ValueError, match="short_factor has 3 values; rotary dim 32 needs one per rotation plane, 16"
    ):
        RotaryEmbedding(HEAD_DIM, theta=THETA, scaling=scaling)
