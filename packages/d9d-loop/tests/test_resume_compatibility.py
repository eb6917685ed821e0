"""Resuming with another global batch or optimizer: converted, refused clearly, or reset on request."""

from __future__ import annotations

from pathlib import Path

import pytest
from loop_toy_job import ToyDataset, collate
from recovery_helpers import run_toy

from d9d.loop import DataConfig, ShardedBatchSource
from d9d.mesh.testing import run_distributed


def _source(global_batch: int) -> ShardedBatchSource[object, object]:
    return ShardedBatchSource(
        dataset=ToyDataset(),
        collator=collate,
        config=DataConfig(shuffle=False),
        global_batch_size=global_batch,
        dp_rank=0,
        dp_size=1,
    )


@pytest.mark.parametrize(
    ("saved_batch", "steps", "new_batch", "expected_step"),
    [
        (32, 4, 16, 8),  # 128 samples consumed: 8 batches of 16
        (32, 3, 48, 2),  # 96 samples: 2 batches of 48
        (32, 4, 32, 4),  # unchanged
    ],
)
def test_data_position_is_converted_in_samples(
    saved_batch: int, steps: int, new_batch: int, expected_step: int
) -> None:
    old = _source(saved_batch)
    for _ in range(steps):
        old.next_batch()
    new = _source(new_batch)
    new.load_state_dict(old.state_dict())
    assert new.state_dict()["step_in_epoch"] == expected_step


def test_a_position_that_is_no_whole_number_of_new_batches_is_refused_naming_both() -> None:
    old = _source(32)
    old.next_batch()
    with pytest.raises(
        ValueError, match=r"global_batch_size=32, not a whole number .*trainer.global_batch_size=24"
    ):
        _source(24).load_state_dict(old.state_dict())


def test_a_run_resumed_with_a_smaller_global_batch_continues_at_the_right_sample(tmp_path: Path) -> None:
    run_distributed(run_toy, str(tmp_path), max_steps=4, data={"shuffle": False}, world_size=1)
    resumed = run_distributed(
        run_toy,
        str(tmp_path),
        max_steps=6,
        trainer={"global_batch_size": 16},
        data={"shuffle": False},
        world_size=1,
    )[0]
    assert resumed["error"] is None
    assert len(resumed["losses"]) == 2  # steps 4 and 5 (optimizer steps are kept, data converted)


def test_another_optimizer_is_refused_with_an_exception_naming_both(tmp_path: Path) -> None:
    run_distributed(run_toy, str(tmp_path), max_steps=2, world_size=1)
    resumed = run_distributed(
        run_toy, str(tmp_path), max_steps=4, optimizer={"name": "sgd", "lr": 0.01}, world_size=1
    )[0]
    error = resumed["error"] or ""
    assert error.startswith("ResumeIncompatibleError"), error
    assert "optimizer AdamW, this run uses SGD" in error and "optimizer_state: reset" in error


def test_another_optimizer_starts_afresh_with_optimizer_state_reset(tmp_path: Path) -> None:
    run_distributed(run_toy, str(tmp_path), max_steps=2, world_size=1)
    resumed = run_distributed(
        run_toy,
        str(tmp_path),
        max_steps=4,
        optimizer={"name": "sgd", "lr": 0.01},
        checkpoint={"resume": {"optimizer_state": "reset"}},
        world_size=1,
    )[0]
    assert resumed["error"] is None
    assert len(resumed["losses"]) == 2  # resumed at step 2


def test_another_model_width_is_refused_before_dcp_naming_each_tensor_and_both_shapes(tmp_path: Path) -> None:
    # DCP used to print 123 lines of tracebacks per rank for this
    run_distributed(run_toy, str(tmp_path), max_steps=2, world_size=1)
    resumed = run_distributed(run_toy, str(tmp_path), max_steps=4, hidden=24, world_size=1)[0]
    error = resumed["error"] or ""
    assert error.startswith("ResumeIncompatibleError"), error
    assert "model.fc1.weight is [16, 8] in the checkpoint, [24, 8] in this run" in error, error
    assert "CheckpointException" not in error and "Traceback" not in error
    assert len(error.splitlines()) < 20
