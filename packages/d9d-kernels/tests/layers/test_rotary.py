"""Rotary embedding provider and applicator: layouts, partial rotation, fixed NTK, meta construction."""

import pytest
import torch

from d9d.kernels.layers import LinearRopeScaling, NtkRopeScaling, RotaryApplicator, RotaryEmbedding

HEAD_DIM = 32
THETA = 50000.0


def test_fixed_length_ntk_equals_dynamic_at_that_length() -> None:
    fixed = RotaryEmbedding(
        HEAD_DIM, scaling=NtkRopeScaling(factor=2.0, max_position_embeddings=16, sequence_length=100)
    )
    dynamic = RotaryEmbedding(HEAD_DIM, scaling=NtkRopeScaling(factor=2.0, max_position_embeddings=16))
    position_ids = torch.arange(100).unsqueeze(0)
    torch.testing.assert_close(fixed(position_ids), dynamic(position_ids))


def test_interleaved_layout_rotates_adjacent_pairs() -> None:
    torch.manual_seed(0)
    rotary = RotaryEmbedding(8, layout="interleaved")
    position_ids = torch.arange(5).unsqueeze(0)
    cos, sin = rotary(position_ids)
    x = torch.randn(1, 5, 3, 8)
    rotated = RotaryApplicator("interleaved")(x, cos, sin)
    angles = position_ids[..., None].float() * rotary.inv_freq  # (1, 5, 4)
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = angles.cos()[:, :, None], angles.sin()[:, :, None]
    expected = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)
    torch.testing.assert_close(rotated, expected, rtol=1e-5, atol=1e-6)


def test_partial_rotary_leaves_trailing_dims_unchanged() -> None:
    torch.manual_seed(0)
    rotary = RotaryEmbedding(16, partial_rotary_factor=0.5)
    cos, sin = rotary(torch.arange(6).unsqueeze(0))
    assert cos.shape == (1, 6, 8)
    x = torch.randn(1, 6, 2, 16)
    rotated = RotaryApplicator()(x, cos, sin)
    torch.testing.assert_close(rotated[..., 8:], x[..., 8:])
    full = RotaryApplicator()(x[..., :8], cos, sin)
    torch.testing.assert_close(rotated[..., :8], full)


def test_meta_built_rotary_recovers_frequencies_after_reset() -> None:
    reference = RotaryEmbedding(HEAD_DIM, theta=THETA, scaling=LinearRopeScaling(factor=2.0))
    with torch.device("meta"):
        rotary = RotaryEmbedding(HEAD_DIM, theta=THETA, scaling=LinearRopeScaling(factor=2.0))
    rotary.to_empty(device="cpu")
    rotary.reset_parameters()
    torch.testing.assert_close(rotary.inv_freq, reference.inv_freq, rtol=0, atol=0)


def test_odd_rotary_dim_is_rejected() -> None:
    with pytest.raises(ValueError, match="rotary dim 5"):
        RotaryEmbedding(10, partial_rotary_factor=0.5)
