"""A NaN from a too-high learning rate no longer trains on to exit code 0: each policy, end to end."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from recovery_helpers import checkpoints, run_toy

from d9d.loop.checkpoint._rollback_walk import RollbackWalk
from d9d.mesh.testing import run_distributed

SGD_TOO_HIGH: dict[str, Any] = {"name": "sgd", "lr": 1e4}
NO_CLIPPING: dict[str, Any] = {"gradient_clipping": {"max_norm": None}}


def _run(tmp_path: Path, policy: dict[str, Any]) -> dict[str, Any]:
    return run_distributed(
        run_toy,
        str(tmp_path),
        max_steps=10,
        trainer={**NO_CLIPPING, "nonfinite": policy},
        optimizer=SGD_TOO_HIGH,
        world_size=1,
    )[0]


def _failed_step(error: str) -> int:
    found = re.search(r"step (\d+): loss", error)
    assert found is not None, error
    return int(found.group(1))


def test_stop_names_the_step_and_saves_nothing_after_it(tmp_path: Path) -> None:
    result = _run(tmp_path, {"policy": "stop"})
    error = result["error"]
    assert error is not None and error.startswith("NonFiniteError: step "), error
    step = _failed_step(error)
    # checkpoint step_N holds N finished steps: the newest is the state before the bad step
    assert checkpoints(tmp_path)[-1] == f"step_{step:09d}"


def test_skip_leaves_parameters_untouched_then_stops_after_max_consecutive(tmp_path: Path) -> None:
    result = _run(tmp_path, {"policy": "skip", "max_consecutive": 2})
    error = result["error"]
    assert error is not None and "for 3 steps in a row (trainer.nonfinite.max_consecutive=2)" in error, error
    assert sum("skipping the optimizer step" in w for w in result["warnings"]) >= 2
    # the skipped steps kept the parameters finite, so their checkpoints are finite too
    assert all(value.isfinite().all() for value in result["params"].values())


def test_rollback_reloads_the_newest_checkpoint_then_older_ones_then_stops_when_it_keeps_diverging(
    tmp_path: Path,
) -> None:
    result = _run(tmp_path, {"policy": "rollback", "max_rollbacks": 2})
    error = result["error"]
    assert error is not None and "after 2 rollbacks" in error, error
    assert sum("rolling back to a checkpoint" in w for w in result["warnings"]) == 2
    step = _failed_step(error)
    assert checkpoints(tmp_path)[-1] == f"step_{step:09d}"  # the last good state is still there
    # failing again before passing the failed step moves to an older checkpoint (it used to
    # reload the same one every time)
    targets = [w.rsplit("/", 1)[1] for w in result["warnings"] if "rolled back to" in w]
    assert targets == [f"step_{step:09d}", f"step_{step - 1:09d}"], result["warnings"]


def test_skip_saves_no_checkpoint_during_a_non_finite_streak(tmp_path: Path) -> None:
    # a checkpoint saved mid-streak held diverged weights (finite, ~5e28) that gave NaN on resume
    result = _run(tmp_path, {"policy": "skip", "max_consecutive": 3})
    skipped = {int(s) for w in result["warnings"] for s in re.findall(r"step (\d+): loss .* skipping", w)}
    assert skipped, result["warnings"]
    saved = {int(name.removeprefix("step_")) for name in checkpoints(tmp_path)}
    # checkpoint step_N holds N finished steps: none right after a skipped step
    assert not {n - 1 for n in saved} & skipped, (saved, skipped)
    assert any("not saving the checkpoint of step" in w for w in result["warnings"])


def test_rollback_without_checkpoints_says_so(tmp_path: Path) -> None:
    result = run_distributed(
        run_toy,
        None,
        max_steps=10,
        trainer={**NO_CLIPPING, "nonfinite": {"policy": "rollback"}},
        optimizer=SGD_TOO_HIGH,
        world_size=1,
    )[0]
    assert "no checkpoint to roll back to" in (result["error"] or ""), result["error"]


def test_a_rollback_walks_back_only_while_the_run_fails_before_passing_the_last_failure() -> None:
    walk = RollbackWalk()
    assert walk.older_than(failed_step=6) is None  # first failure: the newest checkpoint
    walk.moved(failed_step=6, checkpoint_step=5)
    assert walk.older_than(failed_step=6) == 5  # failed again at the same step: older than 5
    walk.moved(failed_step=6, checkpoint_step=4)
    assert walk.older_than(failed_step=5) == 4  # failed even earlier: older still
    walk.moved(failed_step=5, checkpoint_step=3)
    assert walk.older_than(failed_step=9) is None  # passed step 6: a new failure, the newest again
