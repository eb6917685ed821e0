"""A diverged but finite checkpoint: the error names it, and resume.from_step picks an older one."""

from __future__ import annotations

import math
from pathlib import Path

from recovery_helpers import checkpoints, run_toy

from d9d.mesh.testing import run_distributed

HUGE_LR = {"name": "adamw", "lr": 1e30}


def test_a_diverged_checkpoint_is_named_and_an_older_step_can_be_picked(tmp_path: Path) -> None:
    run_distributed(run_toy, str(tmp_path), max_steps=3, world_size=1)
    # a huge lr: step 3's update leaves finite weights near 1e30, saved as step 4; step 4's loss is inf
    diverged = run_distributed(run_toy, str(tmp_path), max_steps=5, optimizer=HUGE_LR, world_size=1)[0]
    assert diverged["error"] is not None and diverged["error"].startswith("NonFiniteError: step 4"), diverged
    assert "step_000000004" in checkpoints(tmp_path)

    # the lr fixed: the rerun resumes from the diverged checkpoint and fails at once; it used to
    # say only "the checkpoints on disk predate this step"
    rerun = run_distributed(run_toy, str(tmp_path), max_steps=5, world_size=1)[0]
    error = rerun["error"]
    assert error is not None and error.startswith("NonFiniteError: step 4"), error
    assert f"this run resumed from {tmp_path / 'step_000000004'}" in error
    assert "resume from an older one with trainer.checkpoint.resume: {from_step: 3}" in error

    picked = run_distributed(
        run_toy, str(tmp_path), max_steps=5, checkpoint={"resume": {"from_step": 3}}, world_size=1
    )[0]
    assert picked["error"] is None, picked["error"]
    assert len(picked["losses"]) == 2 and all(math.isfinite(x) for x in picked["losses"])
    assert any("set aside the newer" in w and "step_000000004.superseded" in w for w in picked["warnings"])
    assert "step_000000004.superseded" in checkpoints(tmp_path)


def test_a_from_step_without_a_checkpoint_is_refused_before_any_work(tmp_path: Path) -> None:
    run_distributed(run_toy, str(tmp_path), max_steps=2, world_size=1)
    result = run_distributed(
        run_toy, str(tmp_path), max_steps=4, checkpoint={"resume": {"from_step": 7}}, world_size=1
    )[0]
    assert result["error"] == (
        f"ValueError: trainer.checkpoint.resume.from_step=7: there is no complete checkpoint of step 7 in "
        f"{tmp_path} (complete checkpoints there: 1, 2); pick one of them, or remove from_step to resume "
        "from the newest"
    )
    assert result["step"] == -1  # refused while configuring: no trainer was built
    assert checkpoints(tmp_path) == ["step_000000001", "step_000000002"]
