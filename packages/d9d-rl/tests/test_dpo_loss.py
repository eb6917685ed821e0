"""DPO and IPO equal TRL's DPOTrainer formulas on hand-built pairs: loss, rewards, margins, accuracy.

The references below are the formulas of TRL's documentation written out pair by pair in plain
Python floats: sigmoid ``-(1 - eps) log s(b h) - eps log s(-b h)``, IPO ``(h - 1/(2b))^2`` with
log-probs averaged over each answer's tokens, rewards ``b (pi - ref)``, margins their difference,
accuracy ``chosen reward > rejected reward``, the loss a mean over pairs.
"""

from __future__ import annotations

import math

import pytest
import torch

from d9d.loop import ComputeLossContext
from d9d.rl import DPOLossConfig, DPOState, DPOTask, dpo_loss, sequence_log_probs

# four pairs: policy/reference log-probs of the chosen and the rejected answer
POLICY_CHOSEN = [-3.0, -7.5, -2.25, -10.0]
POLICY_REJECTED = [-4.0, -6.0, -2.25, -9.0]
REF_CHOSEN = [-3.5, -7.0, -2.0, -10.5]
REF_REJECTED = [-3.5, -6.5, -2.0, -8.0]


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _trl(
    pc: list[float], pr: list[float], rc: list[float], rr: list[float], *, kind: str, beta: float, eps: float
) -> dict[str, list[float] | float]:
    losses, chosen, rejected = [], [], []
    for a, b, c, d in zip(pc, pr, rc, rr, strict=True):
        h = (a - c) - (b - d)
        if kind == "sigmoid":
            losses.append(-(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h))
        else:
            losses.append((h - 1 / (2 * beta)) ** 2)
        chosen.append(beta * (a - c))
        rejected.append(beta * (b - d))
    return {
        "loss": sum(losses) / len(losses),
        "chosen": chosen,
        "rejected": rejected,
        "margins": [x - y for x, y in zip(chosen, rejected, strict=True)],
        "accuracies": [float(x > y) for x, y in zip(chosen, rejected, strict=True)],
    }


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize(
    ("kind", "beta", "eps"),
    [
        ("sigmoid", 0.1, 0.0),  # plain DPO
        ("sigmoid", 0.5, 0.2),  # conservative DPO (label smoothing)
        ("ipo", 0.1, 0.0),  # IPO: the target margin 1/(2 beta) = 5
        ("ipo", 2.0, 0.0),  # IPO: target margin 0.25
    ],
)
def test_loss_rewards_margins_and_accuracy_equal_trls_formulas(kind: str, beta: float, eps: float) -> None:
    config = DPOLossConfig.model_validate({"loss": kind, "beta": beta, "label_smoothing": eps})
    result = dpo_loss(
        chosen_log_probs=_t(POLICY_CHOSEN),
        rejected_log_probs=_t(POLICY_REJECTED),
        ref_chosen_log_probs=_t(REF_CHOSEN),
        ref_rejected_log_probs=_t(REF_REJECTED),
        config=config,
    )
    expected = _trl(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, kind=kind, beta=beta, eps=eps)
    assert result.loss.item() == pytest.approx(expected["loss"], abs=1e-12)
    assert result.chosen_rewards.tolist() == pytest.approx(expected["chosen"], abs=1e-12)
    assert result.rejected_rewards.tolist() == pytest.approx(expected["rejected"], abs=1e-12)
    assert result.margins.tolist() == pytest.approx(expected["margins"], abs=1e-12)
    # pair 1 prefers the rejected answer, pair 2 ties (equal rewards count as wrong, as in TRL)
    assert result.accuracies.tolist() == expected["accuracies"] == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_the_gradient_reaches_the_policy_only_and_equals_the_closed_form(kind: str) -> None:
    beta, eps = 0.3, 0.1 if kind == "sigmoid" else 0.0
    config = DPOLossConfig.model_validate({"loss": kind, "beta": beta, "label_smoothing": eps})
    chosen = _t(POLICY_CHOSEN).requires_grad_()
    rejected = _t(POLICY_REJECTED).requires_grad_()
    ref_chosen = _t(REF_CHOSEN).requires_grad_()
    ref_rejected = _t(REF_REJECTED)
    dpo_loss(
        chosen_log_probs=chosen,
        rejected_log_probs=rejected,
        ref_chosen_log_probs=ref_chosen,
        ref_rejected_log_probs=ref_rejected,
        config=config,
    ).loss.backward()
    h = (_t(POLICY_CHOSEN) - _t(REF_CHOSEN)) - (_t(POLICY_REJECTED) - _t(REF_REJECTED))
    n = len(POLICY_CHOSEN)
    if kind == "sigmoid":
        d_h = (-(1 - eps) * beta * torch.sigmoid(-beta * h) + eps * beta * torch.sigmoid(beta * h)) / n
    else:
        d_h = 2 * (h - 1 / (2 * beta)) / n
    assert chosen.grad is not None and rejected.grad is not None
    torch.testing.assert_close(chosen.grad, d_h, rtol=0, atol=1e-12)
    torch.testing.assert_close(rejected.grad, -d_h, rtol=0, atol=1e-12)
    assert ref_chosen.grad is None  # the reference is a constant


def _token_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two pairs as four interleaved rows of per-token log-probs, answers of 1 to 3 tokens."""
    token_log_probs = torch.tensor(
        [
            [0.0, -1.0, -0.5, -0.25],  # pair 0 chosen: 3 answer tokens
            [0.0, 0.0, -2.0, 0.0],  # pair 0 rejected: 1 answer token
            [-0.75, -1.5, 0.0, 0.0],  # pair 1 chosen: 2 answer tokens
            [-1.0, -0.5, -3.0, 0.0],  # pair 1 rejected: 3 answer tokens
        ],
        dtype=torch.float64,
    )
    targets = torch.full(token_log_probs.shape, -100)
    for row, (start, stop) in enumerate([(1, 4), (2, 3), (0, 2), (0, 3)]):
        targets[row, start:stop] = 7
    ref_sums = torch.tensor([-2.0, -1.5, -2.5, -4.0], dtype=torch.float64)  # summed over answer tokens
    return token_log_probs, targets, ref_sums


@pytest.mark.parametrize(
    ("kind", "counts"),
    [
        ("sigmoid", [1, 1, 1, 1]),  # sums: DPO's sequence log-probability
        ("ipo", [3, 1, 2, 3]),  # IPO averages policy and reference over each answer's tokens
    ],
)
def test_the_task_reduces_tokens_as_trl_does(kind: str, counts: list[int]) -> None:
    token_log_probs, targets, ref_sums = _token_batch()
    config = DPOLossConfig.model_validate({"loss": kind, "beta": 0.2})
    task = DPOTask(config)
    result = task.compute_loss(
        ComputeLossContext(
            pipeline_results=-token_log_probs,  # the model returns -log p per position
            state=DPOState(targets=targets, ref_log_probs=ref_sums),
            microbatch_index=0,
            step=0,
        )
    )
    mask = targets != -100
    sums = [float((token_log_probs[r] * mask[r]).sum()) for r in range(4)]
    policy = [s / c for s, c in zip(sums, counts, strict=True)]
    ref = [float(v) / c for v, c in zip(ref_sums.tolist(), counts, strict=True)]
    expected = _trl(policy[0::2], policy[1::2], ref[0::2], ref[1::2], kind=kind, beta=0.2, eps=0.0)
    assert result.loss.item() == pytest.approx(expected["loss"], abs=1e-6)
    assert result.loss_weight == 2.0  # two pairs
    torch.testing.assert_close(
        sequence_log_probs(token_log_probs, mask, loss=kind), _t(policy), rtol=0, atol=1e-12
    )


def test_bad_configs_and_shapes_are_refused_naming_the_values() -> None:
    with pytest.raises(ValueError, match=r"label_smoothing=0.1 applies to loss 'sigmoid' only"):
        DPOLossConfig.model_validate({"loss": "ipo", "label_smoothing": 0.1})
    with pytest.raises(ValueError, match="beta"):
        DPOLossConfig.model_validate({"beta": 0.0})
    with pytest.raises(ValueError, match=r"one \(pairs,\) shape, got shapes \[\(2,\), \(3,\)\]"):
        dpo_loss(
            chosen_log_probs=torch.zeros(3),
            rejected_log_probs=torch.zeros(3),
            ref_chosen_log_probs=torch.zeros(2),
            ref_rejected_log_probs=torch.zeros(3),
            config=DPOLossConfig(),
        )
    with pytest.raises(ValueError, match="a microbatch of 3 rows splits a chosen/rejected pair"):
        DPOTask().compute_loss(
            ComputeLossContext(
                pipeline_results=torch.zeros(3, 4),
                state=DPOState(targets=torch.zeros(3, 4, dtype=torch.long), ref_log_probs=torch.zeros(3)),
                microbatch_index=0,
                step=0,
            )
        )
