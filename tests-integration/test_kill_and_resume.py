"""A run killed with SIGKILL (between steps or in the middle of a checkpoint save) resumes bit-identically."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from quickstart_job import quickstart_config, run_quickstart

from d9d.mesh.testing import DistributedTestError, run_distributed

STEPS = 6  # kills land at step 2 or 3 (random), each with a checkpoint before it


def _config(directory: Path | None, mesh: dict[str, int]) -> dict[str, Any]:
    """The job, checkpointing every step into ``directory``; ``None``: without checkpoints."""
    trainer: dict[str, Any] = {"max_steps": STEPS}
    if directory is not None:
        trainer["checkpoint"] = {"directory": str(directory), "every_steps": 1, "keep_last": 2}
    return quickstart_config(mesh=mesh, trainer=trainer)


def _run(
    config: dict[str, Any], kill_at_step: int | None, kill_during_save_at_step: int | None
) -> dict[str, Any]:
    return run_quickstart(
        config, kill_at_step=kill_at_step, kill_during_save_at_step=kill_during_save_at_step
    )


_REFERENCES: dict[int, dict[str, Any]] = {}


def _reference(mesh: dict[str, int], world_size: int) -> dict[str, Any]:
    """The uninterrupted run, once per world size for both kill points. It saves no checkpoints:
    saving changes nothing a resumed run computes, so the resumed runs must equal it."""
    if world_size not in _REFERENCES:
        _REFERENCES[world_size] = run_distributed(
            _run, _config(None, mesh), None, None, world_size=world_size, timeout_s=240
        )[0]
    return _REFERENCES[world_size]


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("during_save", [False, True], ids=["between-steps", "during-save"])
def test_killed_run_resumes_bit_identically(tmp_path: Path, world_size: int, during_save: bool) -> None:
    mesh = {} if world_size == 1 else {"data_parallel_replicate": 2, "data_parallel_shard": 2}
    kill_step = random.randrange(2, STEPS - 2)
    reference = _reference(mesh, world_size)

    interrupted = _config(tmp_path / "run", mesh)
    with pytest.raises(DistributedTestError, match="exited with code -9"):
        run_distributed(
            _run,
            interrupted,
            None if during_save else kill_step,
            kill_step if during_save else None,
            world_size=world_size,
            timeout_s=240,
        )
    checkpoints = sorted(p.name for p in (tmp_path / "run").iterdir())
    resumed = run_distributed(_run, interrupted, None, None, world_size=world_size, timeout_s=240)[0]

    resumed_from = resumed["start_step"]
    # killed right after step index `kill_step` ran (before its checkpoint),
    # or inside the save of checkpoint `kill_step`
    expected_start = kill_step - 1 if during_save else kill_step
    assert resumed_from == expected_start, (kill_step, checkpoints)
    assert resumed["losses"] == reference["losses"][resumed_from:], f"kill at step {kill_step}"
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), (
            f"{name} differs after resume (kill at {kill_step})"
        )
