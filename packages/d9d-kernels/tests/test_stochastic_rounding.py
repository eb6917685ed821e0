"""Stochastic rounding and the AdamW step against exact arithmetic and torch.optim.AdamW."""

import os
import warnings

import pytest
import torch

from d9d.kernels import (
    KernelBackend,
    StochasticAdamW,
    adamw_step_stochastic_,
    adamw_step_stochastic_multi_,
    copy_stochastic_,
)

from ._compare import DEVICES

BACKENDS = [
    KernelBackend.REFERENCE,  # plain PyTorch
    KernelBackend.TRITON,  # the Triton kernel (interpreted on CPU)
]
# The Triton kernel on CPU tensors runs only in Triton's interpreter (conftest sets it where no
# GPU is present); on a GPU machine without it those cases skip, as DEVICES' "cpu" does.
_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)
CPU_BACKENDS = [KernelBackend.REFERENCE, pytest.param(KernelBackend.TRITON, marks=_INTERPRETER)]


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
    # 400 draws per element: 8 seeds, each over 50 copies of the source in one call (every element
    # draws its own random bits), so the draws cost 8 launches rather than 400
    copies = source.repeat(50)
    samples = torch.cat(
        [
            copy_stochastic_(torch.empty_like(copies, dtype=torch.bfloat16), copies, seed=s, backend=backend)
            .float()
            .view(50, 64)
            for s in range(8)
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
@pytest.mark.parametrize("backend", CPU_BACKENDS)
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


def _assert_same_update(got: torch.Tensor, expected: torch.Tensor, device: str, what: str) -> None:
    if device != "cuda":
        assert torch.equal(got, expected), f"{what} differs"
        return
    # The GPU compiles the multi-tensor and the per-tensor kernel's arithmetic with different fused
    # multiply-adds: fp32 results may differ in the last bit, and a bf16 one then rarely rounds the
    # other way (one bf16 step).
    tolerance = 2**-7 if got.dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=1e-7, msg=what)


def _operands(
    shapes: list[tuple[int, ...]], param_dtype: torch.dtype, state_dtype: torch.dtype, device: str
) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    params = [torch.randn(shape, generator=generator).to(device, param_dtype) for shape in shapes]
    grads = [torch.randn(shape, generator=generator).to(device, param_dtype) for shape in shapes]
    exp_avgs = [(torch.randn(shape, generator=generator) * 0.1).to(device, state_dtype) for shape in shapes]
    exp_avg_sqs = [torch.rand(shape, generator=generator).to(device, state_dtype) for shape in shapes]
    return [params, grads, exp_avgs, exp_avg_sqs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("param_dtype", "state_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),  # everything rounded stochastically
        (torch.bfloat16, torch.float32),  # fp32 moments
        (torch.float32, torch.float32),  # plain AdamW
    ],
)
def test_adamw_step_multi_equals_one_call_per_parameter(
    backend: KernelBackend, device: str, param_dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    # sizes below, at and across the multi-tensor kernel's 1024-element blocks and 2048-element
    # program chunks; empty ones (also first and last); more tensors than one search step
    shapes = [(0,), (3,), (2048,), (5, 1000), (0,), (1,), (2, 3500), (64, 33), (4100,), (7, 3), (2,), (0, 4)]
    multi = _operands(shapes, param_dtype, state_dtype, device)
    single = [[t.clone() for t in column] for column in multi]
    seeds = [11 * i + 5 for i in range(len(shapes))]
    hyper = {"lr": 0.05, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1, "step": 3}
    adamw_step_stochastic_multi_(*multi, seeds=seeds, backend=backend, **hyper)
    for index, seed in enumerate(seeds):
        adamw_step_stochastic_(*(column[index] for column in single), seed=seed, backend=backend, **hyper)
    for name, got, expected in zip(("param", "grad", "exp_avg", "exp_avg_sq"), multi, single, strict=True):
        for index, (a, b) in enumerate(zip(got, expected, strict=True)):
            _assert_same_update(a, b, device, f"{name} {index}")


def test_adamw_step_multi_names_the_parameter_that_does_not_fit() -> None:
    params, grads, exp_avgs, exp_avg_sqs = _operands([(4,), (3,)], torch.float32, torch.float32, "cpu")
    grads[1] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"parameter 1.*grad shape \(5,\) != param shape \(3,\)"):
        adamw_step_stochastic_multi_(params, grads, exp_avgs, exp_avg_sqs, lr=0.1, step=1)
    with pytest.raises(ValueError, match="2 params, 2 grads, 1 exp_avgs"):
        adamw_step_stochastic_multi_(params, grads, exp_avgs[:1], exp_avg_sqs, lr=0.1, step=1)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_adamw_buckets_by_step_and_dtype(device: str) -> None:
    # bf16 and fp32 parameters in one group, one of them skipping a step: every parameter ends as
    # the per-parameter op leaves it with the same seeds (drawn in the same order).
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(300).to(device, torch.bfloat16)),
        torch.nn.Parameter(torch.randn(5, 7).to(device)),
        torch.nn.Parameter(torch.randn(2100).to(device, torch.bfloat16)),
    ]
    copies = [p.detach().clone() for p in params]
    optimizer = StochasticAdamW(params, lr=0.05, weight_decay=0.1, backend=KernelBackend.TRITON)
    states = [(torch.zeros_like(c), torch.zeros_like(c)) for c in copies]
    steps = [0, 0, 0]
    for iteration in range(3):
        grads = [torch.randn(c.shape).to(device, c.dtype) for c in copies]
        skipped = 2 if iteration == 1 else -1
        for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
            param.grad = None if index == skipped else grad.clone()
        torch.manual_seed(100 + iteration)
        optimizer.step()
        # the optimizer's buckets in order of first appearance: (step, dtype)
        buckets: dict[tuple[int, torch.dtype], list[int]] = {}
        for index in range(3):
            if index != skipped:
                steps[index] += 1
                buckets.setdefault((steps[index], copies[index].dtype), []).append(index)
        torch.manual_seed(100 + iteration)
        for (step, _), members in buckets.items():
            seeds = torch.randint(0, 2**31 - 1, (len(members),)).tolist()
            for index, seed in zip(members, seeds, strict=True):
                adamw_step_stochastic_(
                    copies[index], grads[index], *states[index], lr=0.05, weight_decay=0.1, step=step,
                    seed=seed, beta1=0.9, beta2=0.999, eps=1e-8, backend=KernelBackend.TRITON,
                )  # fmt: skip
        for index, (param, copy) in enumerate(zip(params, copies, strict=True)):
            _assert_same_update(param.detach(), copy, device, f"iteration {iteration}, parameter {index}")


@pytest.mark.parametrize(
    "case",
    [
        "non_contiguous",  # a transposed parameter and its state: per-tensor reference path
        "mixed_dtypes",  # bf16 and fp32 parameters in one call: no single launch covers both
    ],
)
@_INTERPRETER
def test_adamw_step_multi_falls_back_per_parameter(case: str) -> None:
    params, grads, exp_avgs, exp_avg_sqs = _operands([(6, 4), (5,)], torch.float32, torch.float32, "cpu")
    if case == "non_contiguous":
        params[0], grads[0] = params[0].t(), grads[0].t()
        exp_avgs[0], exp_avg_sqs[0] = exp_avgs[0].t(), exp_avg_sqs[0].t()
    else:
        params[1], grads[1] = params[1].to(torch.bfloat16), grads[1].to(torch.bfloat16)
    multi = [params, grads, exp_avgs, exp_avg_sqs]
    single = [[t.clone() for t in column] for column in multi]
    hyper = {"lr": 0.05, "weight_decay": 0.1, "step": 2}
    adamw_step_stochastic_multi_(*multi, seeds=[3, 4], backend=KernelBackend.TRITON, **hyper)
    for index, seed in enumerate([3, 4]):
        adamw_step_stochastic_(
            *(column[index] for column in single), seed=seed, backend=KernelBackend.TRITON, **hyper
        )
    for got, expected in zip(multi, single, strict=True):
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])  # one launch; the per-tensor path
def test_adamw_step_multi_grad_scale_equals_scaled_float32_gradients(
    backend: KernelBackend, device: str, layout: str
) -> None:
    # The factor is applied as the kernel reads each gradient: the same step as the float32
    # gradient grad * scale, and the gradients themselves are left as they are.
    shapes = [(3,), (2048,), (5, 1000), (4100,)]
    multi = _operands(shapes, torch.bfloat16, torch.bfloat16, device)
    if layout == "transposed":
        multi = [[t.t() if t.ndim == 2 else t for t in column] for column in multi]
    single = [[t.clone() for t in column] for column in multi]
    grads_before = [g.clone() for g in multi[1]]
    scale = torch.tensor(0.375, device=device)
    seeds = [7 * i + 1 for i in range(len(shapes))]
    hyper = {"lr": 0.05, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1, "step": 2}
    adamw_step_stochastic_multi_(*multi, seeds=seeds, grad_scale=scale, backend=backend, **hyper)
    for index, seed in enumerate(seeds):
        param, grad, exp_avg, exp_avg_sq = (column[index] for column in single)
        adamw_step_stochastic_(
            param, grad.float() * scale, exp_avg, exp_avg_sq, seed=seed, backend=backend, **hyper
        )
    for got, expected in zip(grads_before, multi[1], strict=True):
        assert torch.equal(got, expected)
    for column, name in ((0, "param"), (2, "exp_avg"), (3, "exp_avg_sq")):
        for index, (a, b) in enumerate(zip(multi[column], single[column], strict=True)):
            _assert_same_update(a, b, device, f"{name} {index}")


def test_adamw_step_multi_refuses_a_grad_scale_of_several_elements() -> None:
    params, grads, exp_avgs, exp_avg_sqs = _operands([(4,)], torch.float32, torch.float32, "cpu")
    with pytest.raises(
        ValueError, match=r"grad_scale must be a one-element floating tensor, got shape \(2,\)"
    ):
        adamw_step_stochastic_multi_(
            params, grads, exp_avgs, exp_avg_sqs, lr=0.1, step=1, grad_scale=torch.ones(2)
        )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_stochastic_adamw_step_with_gradient_scale_equals_scaling_first(backend: KernelBackend) -> None:
    # fp32 parameters and gradients: multiplying the gradients first (as clipping in place does)
    # gives bit for bit the same step.
    torch.manual_seed(0)
    fused = [torch.nn.Parameter(torch.randn(shape)) for shape in [(3, 700), (11,)]]
    scaled = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    optimizers = [StochasticAdamW(ps, lr=0.05, weight_decay=0.1, backend=backend) for ps in (fused, scaled)]
    for iteration in range(3):
        grads = [torch.randn(p.shape) for p in fused]
        scale = torch.tensor(0.5 + iteration)
        for a, b, grad in zip(fused, scaled, grads, strict=True):
            a.grad, b.grad = grad.clone(), grad * scale
        torch.manual_seed(iteration)
        optimizers[0].step_with_gradient_scale(scale)
        torch.manual_seed(iteration)
        optimizers[1].step()
        for a, b in zip(fused, scaled, strict=True):
            assert torch.equal(a, b)


def test_stochastic_adamw_step_with_gradient_scale_is_a_step_for_hooks_and_schedulers() -> None:
    param = torch.nn.Parameter(torch.randn(4))
    optimizer = StochasticAdamW([param], lr=0.1, backend=KernelBackend.REFERENCE)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    seen: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: seen.append("pre"))
    optimizer.register_step_post_hook(lambda *_: seen.append("post"))
    param.grad = torch.ones(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        optimizer.step_with_gradient_scale(torch.tensor(0.5))
        scheduler.step()
    assert seen == ["pre", "post"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_adamw_step_rounding_is_unbiased_and_independent_across_elements_and_states(
    backend: KernelBackend,
) -> None:
    # Every element gets the same update, so the roundings must average to the exact value, and
    # elements that share one random draw in the kernel, and the parameter and its first moment,
    # must round independently.
    n = 1 << 15
    param = torch.ones(n, dtype=torch.bfloat16)
    grad = torch.full((n,), 0.3, dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    lr = 0.3 * 2.0**-8  # a third of a bf16 step below 1.0
    adamw_step_stochastic_(
        param, grad, exp_avg, exp_avg_sq, lr=lr, weight_decay=0.0, step=1, seed=3, backend=backend
    )
    exact_param = 1.0 - lr  # step 1: m_hat / sqrt(v_hat) = 1 (eps is negligible)
    exact_exp_avg = 0.1 * float(grad[0])
    param_up = (param.float() == 1.0).float()  # rounded up to 1.0 (else down to 1 - 2**-8)
    avg_down, avg_up = _bf16_neighbours(torch.tensor([exact_exp_avg]))
    assert bool(((exp_avg.float() == avg_down) | (exp_avg.float() == avg_up)).all())
    avg_rounded_up = (exp_avg.float() == avg_up).float()
    p_param, p_avg = float(param_up.mean()), float(avg_rounded_up.mean())
    # Unbiased: P(up) equals the truncated fraction (4 sigma over 32768 draws is about 0.011).
    assert abs(p_param - (exact_param - (1.0 - 2.0**-8)) / 2.0**-8) < 0.012
    assert abs(p_avg - (exact_exp_avg - float(avg_down)) / float(avg_up - avg_down)) < 0.012
    # Independent: joint frequencies are the products of the marginals.
    for lag in (1, 2, 512, 1024, 2048):  # whichever elements the kernel pairs on one draw
        both = float((param_up[:-lag] * param_up[lag:]).mean())
        assert abs(both - p_param**2) < 0.012, f"elements {lag} apart round together: {both} vs {p_param**2}"

    assert abs(float((param_up * avg_rounded_up).mean()) - p_param * p_avg) < 0.012


def test_stochastic_adamw_reads_step_counts_without_a_scalar_read_per_parameter() -> None:
    # A LoRA model has hundreds of small parameters: a `.item()` per parameter per step kept the
    # device idle for ~20 ms of host time on an 8B LoRA step. The counts are read in one go.
    params = [torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16)) for _ in range(40)]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = StochasticAdamW(params, lr=1e-3)
    optimizer.step()
    with torch.profiler.profile() as profile:
        optimizer.step()
    reads = [event.name for event in profile.events() if event.name == "aten::item"]
    assert reads == []
    assert [float(optimizer.state[p]["step"]) for p in params] == [2.0] * 40
