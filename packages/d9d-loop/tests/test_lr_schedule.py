import math

import pytest
import torch

from d9d.loop import (
    AutoLRSchedulerProvider,
    LRSchedulerProviderContext,
    PiecewiseLRSchedulerConfig,
    PiecewiseSchedule,
)


def schedule(raw: dict[str, object], total: int = 100) -> PiecewiseSchedule:
    return PiecewiseSchedule(PiecewiseLRSchedulerConfig.model_validate(raw), total)


def test_warmup_then_cosine_to_end_factor() -> None:
    s = schedule({"warmup": {"steps": 10}, "phases": [{"kind": "cosine", "steps": 90, "end_factor": 0.1}]})
    assert s(0) == 0.0
    assert s(5) == pytest.approx(0.5)
    assert s(10) == pytest.approx(1.0)
    assert s(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(100) == pytest.approx(0.1)
    assert s(1000) == pytest.approx(0.1)  # after the last phase the factor holds


def test_fractions_of_the_run_and_chained_phases() -> None:
    s = schedule(
        {
            "warmup": {"fraction": 0.1, "start_factor": 0.2},
            "phases": [
                {"kind": "constant", "fraction": 0.4},
                {"kind": "linear", "fraction": 0.25, "end_factor": 0.5},
                {"kind": "exponential", "fraction": 0.25, "end_factor": 0.05},
            ],
        },
        total=200,
    )
    assert s(0) == pytest.approx(0.2)
    assert s(20) == pytest.approx(1.0)  # warm-up is 10% of 200 steps
    assert s(99) == pytest.approx(1.0)
    assert s(125) == pytest.approx(0.75)  # halfway down the linear phase
    assert s(150) == pytest.approx(0.5)
    assert s(175) == pytest.approx(0.5 * (0.05 / 0.5) ** 0.5)
    assert s(200) == pytest.approx(0.05)


def test_phase_needs_one_length() -> None:
    with pytest.raises(ValueError, match="exactly one of 'steps' and 'fraction'"):
        PiecewiseLRSchedulerConfig.model_validate({"phases": [{"kind": "constant"}]})


def test_provider_builds_a_lambda_scheduler_that_steps() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    config = PiecewiseLRSchedulerConfig.model_validate(
        {"warmup": {"steps": 2}, "phases": [{"kind": "constant", "steps": 2}]}
    )
    scheduler = AutoLRSchedulerProvider(config).build(
        LRSchedulerProviderContext(dist_context=None, optimizer=optimizer, total_steps=4)  # type: ignore[arg-type]
    )
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == [0.0, 1.0, 2.0, 2.0]
