import pytest
import torch
from torch import nn

from d9d.pipeline import StagesLRScheduler, StagesOptimizer


def _stages() -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(3, 3), nn.Linear(3, 2)]


def test_steps_every_stage_and_round_trips_state() -> None:
    stages = _stages()
    opts = [torch.optim.AdamW(s.parameters(), lr=0.1) for s in stages]
    optimizer = StagesOptimizer(opts)
    scheduler = StagesLRScheduler([torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts])
    before = [s.weight.detach().clone() for s in stages]
    stages[1](stages[0](torch.ones(1, 3))).sum().backward()
    optimizer.step()
    scheduler.step()
    assert all(not torch.equal(b, s.weight) for b, s in zip(before, stages, strict=True))
    assert scheduler.get_last_lr() == [0.05]
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.05]
    optimizer.zero_grad()
    assert all(p.grad is None for s in stages for p in s.parameters())

    state, sched_state = optimizer.state_dict(), scheduler.state_dict()
    assert sorted(state) == ["stage_0", "stage_1"]
    fresh_opts = [torch.optim.AdamW(s.parameters(), lr=0.1) for s in _stages()]
    fresh = StagesOptimizer(fresh_opts)
    fresh.load_state_dict(state)
    fresh_sched = StagesLRScheduler(
        [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in fresh_opts]
    )
    fresh_sched.load_state_dict(sched_state)
    assert fresh.optimizers[1].state_dict()["state"][0]["step"] == 1
    assert fresh_sched.schedulers[0].state_dict()["last_epoch"] == 1


def test_missing_stage_state_is_named() -> None:
    optimizer = StagesOptimizer([torch.optim.SGD(s.parameters(), lr=0.1) for s in _stages()])
    with pytest.raises(KeyError, match="'stage_1' is missing"):
        optimizer.load_state_dict({"stage_0": optimizer.optimizers[0].state_dict()})
