"""Trainer sleep/wake: state leaves the device and returns bit-exact; training is unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from loop_toy_job import build_trainer, full_parameters, toy_config

from d9d.loop import (
    EventBus,
    ForwardBackwardFinished,
    SleepFinished,
    SleepStarted,
    StepFinished,
    TensorOffloader,
    Trainer,
    WakeFinished,
    WakeStarted,
)
from d9d.mesh.testing import run_distributed


def _local_storage_bytes(trainer: Trainer) -> int:
    total = 0
    for stage in trainer.model_stages:
        for parameter in stage.parameters():
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            total += local.untyped_storage().nbytes()
    return total


def _train(mesh: dict[str, int], sleep_between_steps: bool) -> dict[str, Any]:
    config = toy_config(mesh=mesh, trainer={"max_steps": 4})
    events = EventBus()
    losses: list[float] = []
    log: list[str] = []
    events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
    for kind in (SleepStarted, SleepFinished, WakeStarted, WakeFinished):
        events.subscribe(kind, lambda e: log.append(type(e).__name__))
    trainer = build_trainer(config, events=events, strategy="fsdp" if mesh else "hsdp")
    asleep_bytes: list[int] = []

    def cycle(event: StepFinished) -> None:
        # between steps: sleep, check the device holds nothing of the model, wake on odd steps
        trainer.sleep()
        asleep_bytes.append(_local_storage_bytes(trainer))
        if event.step % 2:
            trainer.wake()  # even steps are woken by the next step itself

    if sleep_between_steps:
        events.subscribe(StepFinished, cycle)
    with trainer:
        awake_bytes = _local_storage_bytes(trainer)
        trainer.train()
        trainer.wake()
        return {
            "losses": losses,
            "parameters": full_parameters(trainer),
            "optimizer": [
                {k: v.to_local().clone() if hasattr(v, "to_local") else v.clone() for k, v in s.items()}
                for s in trainer.optimizer.state.values()
            ],
            "asleep_bytes": asleep_bytes,
            "awake_bytes": awake_bytes,
            "log": log,
        }


@pytest.mark.parametrize(
    "mesh",
    [
        {},  # one process
        {"data_parallel_shard": 4},  # FSDP on 4 ranks: flat shards keep their aliasing
    ],
)
def test_sleep_and_wake_leave_training_bit_identical(mesh: dict[str, int]) -> None:
    world = 4 if mesh else 1
    plain = run_distributed(_train, mesh, False, world_size=world, timeout_s=120)
    slept = run_distributed(_train, mesh, True, world_size=world, timeout_s=120)
    for a, b in zip(plain, slept, strict=True):
        assert a["losses"] == b["losses"]
        for name, value in a["parameters"].items():
            assert torch.equal(value, b["parameters"][name]), name
        for state_a, state_b in zip(a["optimizer"], b["optimizer"], strict=True):
            for key, value in state_a.items():
                assert torch.equal(value, state_b[key]), key
        assert b["asleep_bytes"] == [0, 0, 0, 0]
        assert b["awake_bytes"] > 0
        assert b["log"][:4] == ["SleepStarted", "SleepFinished", "WakeStarted", "WakeFinished"]


def test_offloader_keeps_views_and_aliases() -> None:
    base = torch.arange(12, dtype=torch.float32)
    view = base[3:7]
    other = torch.ones(3)
    offloader = TensorOffloader(torch.device("cpu"))
    moved = offloader.offload([view, base, other])  # one storage counted once
    assert moved == 12 * 4 + 3 * 4
    assert base.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="offloaded already"):
        offloader.offload([base])
    assert offloader.restore() == moved
    assert torch.equal(base, torch.arange(12, dtype=torch.float32))
    assert torch.equal(view, torch.arange(3, 7, dtype=torch.float32))
    view.fill_(0)  # still a view of base
    assert base[3:7].sum() == 0
