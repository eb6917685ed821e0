"""GRPO and REINFORCE against a hand-written, loop-by-loop reference (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from d9d.rl import GRPOLossConfig, group_advantages, grpo_loss, reinforce_loss


def _reference_grpo(
    lp: list[list[float]],
    old: list[list[float]],
    ref: list[list[float]],
    adv: list[float],
    mask: list[list[int]],
    *,
    eps_low: float,
    eps_high: float,
    beta: float,
    averaging: str,
) -> float:
    """The DeepSeekMath objective written token by token in plain Python."""
    sequence_means: list[float] = []
    token_terms: list[float] = []
    for i, row in enumerate(lp):
        terms: list[float] = []
        for t, value in enumerate(row):
            if not mask[i][t]:
                continue
            ratio = math.exp(value - old[i][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            term = -min(ratio * adv[i], clipped * adv[i])
            d = ref[i][t] - value
            term += beta * (math.exp(d) - d - 1)
            terms.append(term)
        token_terms += terms
        sequence_means.append(sum(terms) / max(len(terms), 1))
    if averaging == "token":
        return sum(token_terms) / len(token_terms)
    return sum(sequence_means) / len(sequence_means)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    old = lp + 0.4 * torch.randn(4, 6, generator=g, dtype=torch.float64)  # ratios far enough to clip
    ref = lp + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 0.0, 2.0], dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool
    )
    return lp, old, ref, adv, mask


CASES = [
    (0.2, 0.2, 0.0, "token"),  # plain GRPO, DAPO-style token mean
    (0.2, 0.2, 0.0, "sequence"),  # the paper's per-sequence mean
    (0.2, 0.28, 0.04, "token"),  # clip-higher with a k3 KL term
    (0.1, 0.1, 0.5, "sequence"),  # tight clip, strong KL
]


@pytest.mark.parametrize(("eps_low", "eps_high", "beta", "averaging"), CASES)
def test_grpo_loss_and_gradient_equal_the_reference(
    eps_low: float, eps_high: float, beta: float, averaging: str
) -> None:
    lp, old, ref, adv, mask = _inputs()
    config = GRPOLossConfig.model_validate(
        {"epsilon_low": eps_low, "epsilon_high": eps_high, "kl_coefficient": beta, "averaging": averaging}
    )
    leaf = lp.clone().requires_grad_(True)
    result = grpo_loss(
        log_probs=leaf, old_log_probs=old, advantages=adv, mask=mask, config=config, ref_log_probs=ref
    )
    result.loss.backward()
    assert leaf.grad is not None

    def reference(values: torch.Tensor) -> float:
        return _reference_grpo(
            values.tolist(),
            old.tolist(),
            ref.tolist(),
            adv.tolist(),
            mask.int().tolist(),
            eps_low=eps_low,
            eps_high=eps_high,
            beta=beta,
            averaging=averaging,
        )

    assert result.loss.item() == pytest.approx(reference(lp), abs=1e-12)
    # central differences of the reference, token by token
    h = 1e-6
    numeric = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            up, down = lp.clone(), lp.clone()
            up[i, t] += h
            down[i, t] -= h
            numeric[i, t] = (reference(up) - reference(down)) / (2 * h)
    torch.testing.assert_close(leaf.grad, numeric, atol=1e-6, rtol=1e-6)
    expected_weight = float(mask.sum()) if averaging == "token" else 4.0
    assert result.weight == expected_weight
    assert 0.0 < result.clip_fraction < 1.0


def test_grpo_needs_a_reference_for_kl() -> None:
    lp, old, _, adv, mask = _inputs()
    with pytest.raises(ValueError, match=r"kl_coefficient=0\.1 needs ref_log_probs"):
        grpo_loss(
            log_probs=lp,
            old_log_probs=old,
            advantages=adv,
            mask=mask,
            config=GRPOLossConfig(kl_coefficient=0.1),
        )


def test_on_policy_grpo_gradient_is_the_reinforce_gradient() -> None:
    # ratio == 1 everywhere: nothing is clipped and both losses have the same gradient
    lp, _, _, adv, mask = _inputs()
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    grpo_loss(
        log_probs=a, old_log_probs=lp, advantages=adv, mask=mask, config=GRPOLossConfig()
    ).loss.backward()
    reinforce_loss(log_probs=b, advantages=adv, mask=mask).loss.backward()
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, b.grad)


def test_reinforce_loss_is_minus_advantage_times_log_prob() -> None:
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -4.0]])
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, -2.0])
    token = reinforce_loss(log_probs=lp, advantages=adv, mask=mask)
    assert token.loss.item() == pytest.approx((1.0 + 2.0 - 1.0) / 3)
    sequence = reinforce_loss(log_probs=lp, advantages=adv, mask=mask, averaging="sequence")
    assert sequence.loss.item() == pytest.approx((1.5 + -1.0) / 2)


def test_group_advantages_normalize_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    torch.testing.assert_close(adv[4:], torch.zeros(4))  # equal rewards: no signal
    torch.testing.assert_close(
        group_advantages(rewards, 4, scale=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5])
    )
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(rewards, 3)
