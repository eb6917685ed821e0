"""On resume the config wins over the settings a checkpoint restores, with one line per change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from recovery_helpers import run_toy

from d9d.mesh.testing import run_distributed

COSINE: dict[str, Any] = {"name": "piecewise", "phases": [{"kind": "cosine", "fraction": 1.0}]}


def _config_wins(warnings: list[str]) -> list[str]:
    return [w.split("the config wins: ", 1)[1] for w in warnings if "the config wins: " in w]


def test_a_changed_lr_and_weight_decay_are_used_from_the_first_resumed_step_and_named(tmp_path: Path) -> None:
    # resuming with another optimizer.lr trained at the checkpoint's lr without a word
    run_distributed(
        run_toy, str(tmp_path), max_steps=2, optimizer={"name": "adamw", "lr": 0.01}, world_size=1
    )
    resumed = run_distributed(
        run_toy,
        str(tmp_path),
        max_steps=4,
        optimizer={"name": "adamw", "lr": 0.02, "weight_decay": 0.5},
        world_size=1,
    )[0]
    assert resumed["error"] is None, resumed["error"]
    assert resumed["lrs"] == [0.02, 0.02]
    assert _config_wins(resumed["warnings"]) == [
        "optimizer.weight_decay: 0.01 in the checkpoint, 0.5 in the config",
        "optimizer.lr: 0.01 in the checkpoint, 0.02 in the config",
        "the run's length (trainer.max_steps / epochs, the LR schedule's horizon): 2 steps in the "
        "checkpoint, 4 in the config",
        "learning rate at step 2: 0.01 in the checkpoint, 0.02 from the config's schedule",
    ]


def test_a_longer_run_follows_the_configs_schedule_from_the_first_resumed_step(tmp_path: Path) -> None:
    # a longer max_steps made the lr jump one step after resuming (0.00091 to 0.0025)
    uninterrupted = run_distributed(run_toy, None, max_steps=8, lr_scheduler=COSINE, world_size=1)[0]
    run_distributed(run_toy, str(tmp_path), max_steps=4, lr_scheduler=COSINE, world_size=1)
    resumed = run_distributed(run_toy, str(tmp_path), max_steps=8, lr_scheduler=COSINE, world_size=1)[0]
    assert resumed["error"] is None, resumed["error"]
    assert resumed["lrs"] == uninterrupted["lrs"][4:]
    lines = _config_wins(resumed["warnings"])
    assert lines[0].endswith("4 steps in the checkpoint, 8 in the config"), lines
    assert lines[1].startswith("learning rate at step 4: 0 in the checkpoint, 0.005 from"), lines


def test_an_unchanged_config_resumes_without_a_line(tmp_path: Path) -> None:
    run_distributed(run_toy, str(tmp_path), max_steps=3, lr_scheduler=COSINE, world_size=1)
    (tmp_path / "step_000000003").rename(tmp_path / "set_aside")  # resume at step 2 of 3
    resumed = run_distributed(run_toy, str(tmp_path), max_steps=3, lr_scheduler=COSINE, world_size=1)[0]
    assert resumed["error"] is None and len(resumed["lrs"]) == 1
    assert _config_wins(resumed["warnings"]) == []


def test_another_global_batch_is_named_with_the_position_kept_in_samples(tmp_path: Path) -> None:
    run_distributed(run_toy, str(tmp_path), max_steps=2, data={"shuffle": False}, world_size=1)
    resumed = run_distributed(
        run_toy,
        str(tmp_path),
        max_steps=6,
        trainer={"global_batch_size": 16},
        data={"shuffle": False},
        world_size=1,
    )[0]
    assert resumed["error"] is None, resumed["error"]
    # the step counter is kept (max_steps and the schedule count steps), the data position in samples
    assert (
        "trainer.global_batch_size: 32 in the checkpoint, 16 in the config: the step stays 2 "
        "(trainer.max_steps and the LR schedule count optimizer steps), the data continues at the next "
        "unread sample (its position is kept in samples)" in _config_wins(resumed["warnings"])
    )
    assert len(resumed["losses"]) == 4  # steps 2 to 5 of max_steps 6


def test_other_data_is_named(tmp_path: Path) -> None:
    # a changed dataset carried on from the old data's position without a word
    run_distributed(run_toy, str(tmp_path), max_steps=2, world_size=1)
    resumed = run_distributed(run_toy, str(tmp_path), max_steps=3, samples=256, world_size=1)[0]
    assert resumed["error"] is None, resumed["error"]
    assert _config_wins(resumed["warnings"]) == [
        "the run's length (trainer.max_steps / epochs, the LR schedule's horizon): 2 steps in the "
        "checkpoint, 3 in the config",
        "the data: 512 samples in the checkpoint, 256 samples in the config (read from the saved "
        "position: epoch and sample)",
    ]


@pytest.mark.parametrize(
    ("saved", "configured"),
    [
        (torch.float32, torch.bfloat16),  # master_dtype: bfloat16 on a float32 run's checkpoint
        (torch.bfloat16, torch.float32),  # and back
    ],
)
def test_another_parameter_dtype_is_named(
    tmp_path: Path, saved: torch.dtype, configured: torch.dtype
) -> None:
    # the checkpoint's float32 weights were cast to bfloat16 on load without a word
    run_distributed(run_toy, str(tmp_path), max_steps=2, dtype=saved, world_size=1)
    resumed = run_distributed(run_toy, str(tmp_path), max_steps=2, dtype=configured, world_size=1)[0]
    assert resumed["error"] is None, resumed["error"]
    old, new = str(saved).removeprefix("torch."), str(configured).removeprefix("torch.")
    assert _config_wins(resumed["warnings"]) == [
        f"model parameter dtype: {old} in the checkpoint, {new} in the config (4 tensors cast as they "
        "load; e.g. model.master_dtype / model.param_dtype)"
    ]
    assert all(p.dtype == configured for p in resumed["params"].values())


def test_a_run_resumed_past_its_max_steps_is_refused(tmp_path: Path) -> None:
    # max_steps below the resumed step trained nothing and said nothing
    run_distributed(run_toy, str(tmp_path), max_steps=3, world_size=1)
    shorter = run_distributed(run_toy, str(tmp_path), max_steps=2, world_size=1)[0]
    assert shorter["error"] is not None and shorter["error"].startswith(
        f"ValueError: resumed from {tmp_path / 'step_000000003'} at step 3, past this run's 2 steps"
    ), shorter["error"]
    assert shorter["losses"] == []


def test_a_finished_run_says_so_and_trains_nothing(tmp_path: Path) -> None:
    run_distributed(run_toy, str(tmp_path), max_steps=3, world_size=1)
    again = run_distributed(run_toy, str(tmp_path), max_steps=3, world_size=1)[0]
    assert again["error"] is None and again["losses"] == [] and again["step"] == 3
    finished = f"already finished at step 3 (resumed from {tmp_path / 'step_000000003'}): nothing to train"
    assert any(w.endswith(finished) for w in again["warnings"]), again["warnings"]
