"""Stochastic rounding and the AdamW step against exact arithmetic and torch.optim.AdamW."""

import pytest
import torch

from d9d.kernels import KernelBackend, StochasticAdamW, adamw_step_stochastic_, copy_stochastic_

from ._compare import DEVICES

BACKENDS = [
    KernelBackend.REFERENCE,  # plain PyTorch
    KernelBackend.TRITON,  # the Triton kernel (interpreted on CPU)
]


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    down = (x.view(torch.int32) & -(1 << 16)).view(torch.float32)  # truncation toward zero
    up = (down.view(torch.int32) + (1 << 16)).view(torch.float32)  # next bf16 away from zero
    return down, up


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_stochastic_rounds_to_a_neighbour_without_bias(backend: KernelBackend, device: str) -> None:
    torch.manual_seed(0)
    source = (torch.randn(64) * 10).to(device)
    source[0] = 1.5  # exactly representable: must be kept
    samples = torch.stack(
        [
            copy_stochastic_(
                torch.empty(64, dtype=torch.bfloat16, device=device), source, seed=s, backend=backend
            ).float()
            for s in range(400)
        ]
    )
    down, up = _bf16_neighbours(source)
    assert bool(((samples == down) | (samples == up)).all())
    assert bool((samples[:, 0] == 1.5).all())
    # mean of 400 draws: within 4 standard deviations (at most half a step / sqrt(400)) of the source
    step = (up - down).abs()
    assert bool(((samples.mean(0) - source).abs() <= 4 * 0.5 * step / 20).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_stochastic_is_deterministic_for_a_seed(backend: KernelBackend, device: str) -> None:
    source = torch.randn(100, device=device)
    a = copy_stochastic_(
        torch.empty(100, dtype=torch.bfloat16, device=device), source, seed=7, backend=backend
    )
    b = copy_stochastic_(
        torch.empty(100, dtype=torch.bfloat16, device=device), source, seed=7, backend=backend
    )
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_step_fp32_matches_torch_adamw(backend: KernelBackend, device: str) -> None:
    torch.manual_seed(0)
    param = torch.randn(37, device=device)
    expected = param.clone().requires_grad_()
    reference = torch.optim.AdamW([expected], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    exp_avg, exp_avg_sq = torch.zeros(37, device=device), torch.zeros(37, device=device)
    for step in range(1, 4):
        grad = torch.randn(37, device=device)
        expected.grad = grad.clone()
        reference.step()
        adamw_step_stochastic_(
            param, grad, exp_avg, exp_avg_sq, lr=0.1, beta1=0.8, beta2=0.9, eps=1e-6,
            weight_decay=0.05, step=step, backend=backend,
        )  # fmt: skip
    torch.testing.assert_close(param, expected.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "state_dtype",
    [
        torch.float32,  # fp32 moments
        torch.bfloat16,  # bf16 moments, stochastically rounded too
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_step_bf16_stays_within_one_step_of_fp32(
    backend: KernelBackend, state_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    param32 = torch.randn(64)
    param = param32.to(torch.bfloat16)
    grad = torch.randn(64).to(torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros(64, dtype=state_dtype), torch.zeros(64, dtype=state_dtype)
    exact = param.float().clone()
    exact_ref = exact.clone().requires_grad_()
    exact_ref.grad = grad.float()
    torch.optim.AdamW([exact_ref], lr=0.01, weight_decay=0.1).step()
    adamw_step_stochastic_(
        param, grad, exp_avg, exp_avg_sq, lr=0.01, weight_decay=0.1, step=1, backend=backend
    )
    down, up = _bf16_neighbours(exact_ref.detach())
    assert bool(((param.float() == down) | (param.float() == up)).all())


def test_stochastic_adamw_fp32_matches_torch_adamw() -> None:
    torch.manual_seed(0)
    ours = torch.nn.Linear(5, 3)
    theirs = torch.nn.Linear(5, 3)
    theirs.load_state_dict(ours.state_dict())
    opt_ours = StochasticAdamW(ours.parameters(), lr=0.05, weight_decay=0.1)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=0.05, weight_decay=0.1)
    for _ in range(3):
        x = torch.randn(4, 5)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_copy_stochastic_rejects_wrong_dtype() -> None:
    with pytest.raises(ValueError, match="target must be bf16"):
        copy_stochastic_(torch.empty(3), torch.empty(3))
