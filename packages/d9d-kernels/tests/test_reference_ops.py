"""The PyTorch reference implementations against independent formulations of each op."""

import math

import pytest
import torch
import torch.nn.functional as F

from d9d.kernels import (
    KernelBackend,
    apply_rope,
    grouped_mm,
    linear_cross_entropy,
    moe_permute,
    moe_unpermute,
    rms_norm,
    swiglu,
)

REF = KernelBackend.REFERENCE


@pytest.mark.parametrize(
    "zero_centered",
    [
        False,  # plain weight
        True,  # 1 + weight
    ],
)
def test_rms_norm_matches_torch(zero_centered: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    w = torch.randn(24, dtype=torch.float64)
    expected = F.rms_norm(x, (24,), (1 + w) if zero_centered else w, eps=1e-5)
    got = rms_norm(x, w, 1e-5, zero_centered_weight=zero_centered, backend=REF)
    torch.testing.assert_close(got, expected)


def test_rms_norm_rejects_wrong_weight() -> None:
    with pytest.raises(ValueError, match=r"weight shape \(7,\)"):
        rms_norm(torch.zeros(2, 8), torch.zeros(7))


def test_swiglu_matches_formula() -> None:
    torch.manual_seed(0)
    gate, up = torch.randn(2, 3, 40), torch.randn(2, 3, 40)
    torch.testing.assert_close(swiglu(gate, up, backend=REF), gate * torch.sigmoid(gate) * up)


def _rope_by_pairs(x: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # Independent formulation: rotate each plane (a, b) by its angle with complex multiplication.
    d = x.shape[-1]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.complex(a, b) * torch.polar(torch.ones_like(freqs), freqs).unsqueeze(2)
    if interleaved:
        return torch.stack((rotated.real, rotated.imag), dim=-1).flatten(-2)
    return torch.cat((rotated.real, rotated.imag), dim=-1)


@pytest.mark.parametrize(
    "layout",
    [
        "half",  # Llama / Qwen: i pairs with i + d/2, cos = cat(f, f)
        "interleaved",  # GPT-J: 2i pairs with 2i + 1, cos = repeat_interleave(f, 2)
    ],
)
def test_rope_matches_complex_rotation(layout: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    freqs = torch.randn(2, 5, 4, dtype=torch.float64)
    angles = freqs.repeat_interleave(2, dim=-1) if layout == "interleaved" else torch.cat((freqs, freqs), -1)
    got = apply_rope(x, angles.cos(), angles.sin(), layout=layout, backend=REF)  # pyright: ignore[reportArgumentType]
    torch.testing.assert_close(got, _rope_by_pairs(x, freqs, layout == "interleaved"))


@pytest.mark.parametrize(
    "reduction",
    [
        "none",  # per-token, 0 at ignored
        "sum",
        "mean",  # over non-ignored tokens only
    ],
)
def test_linear_cross_entropy_matches_log_softmax(reduction: str) -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 4, dtype=torch.float64), torch.randn(11, 4, dtype=torch.float64)
    labels = torch.tensor([0, 3, -100, 10, 5, -100])
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)
    per_token = torch.tensor([-logp[i, t] if t >= 0 else 0.0 for i, t in enumerate(labels.tolist())])
    expected = {"none": per_token, "sum": per_token.sum(), "mean": per_token.sum() / 4}[reduction]
    got = linear_cross_entropy(hidden, weight, labels, reduction=reduction, backend=REF)  # pyright: ignore[reportArgumentType]
    torch.testing.assert_close(got, expected.to(got.dtype))


def test_linear_cross_entropy_mean_is_zero_when_all_ignored() -> None:
    loss = linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.full((3,), -100), backend=REF)
    assert loss.item() == 0.0


def test_moe_permute_and_unpermute_round_trip() -> None:
    torch.manual_seed(0)
    tokens, top_k, experts = 7, 2, 4
    hidden = torch.randn(tokens, 3)
    indices = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    permuted, counts, permutation = moe_permute(hidden, indices, experts, backend=REF)
    assert counts.tolist() == [int((indices == e).sum()) for e in range(experts)]
    # rows are grouped by expert, stable in token order, and each row is its token's state
    flat = indices.reshape(-1)
    assert flat[permutation].tolist() == sorted(flat.tolist())
    torch.testing.assert_close(permuted, hidden[permutation // top_k])
    for e in range(experts):
        pairs = permutation[flat[permutation] == e]
        assert pairs.tolist() == sorted(pairs.tolist())
    weights = torch.rand(tokens, top_k)
    combined = moe_unpermute(permuted * 2, permutation, weights, backend=REF)
    torch.testing.assert_close(combined, 2 * hidden * weights.sum(-1, keepdim=True))


def test_grouped_mm_matches_per_group_loop() -> None:
    torch.manual_seed(0)
    sizes = [3, 0, 5, 1]  # includes an empty group
    x, weight = torch.randn(sum(sizes), 6), torch.randn(4, 6, 5)
    got = grouped_mm(x, weight, torch.tensor(sizes), backend=REF)
    start = 0
    for g, n in enumerate(sizes):
        torch.testing.assert_close(got[start : start + n], x[start : start + n] @ weight[g])
        start += n
    assert not math.isnan(got.sum().item())
