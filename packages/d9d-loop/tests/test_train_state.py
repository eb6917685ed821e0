"""d9d's train state loads without pickle: ``torch.load(weights_only=True)`` or a clear refusal.

A checkpoint's train state (step, data position, scheduler, task, tracker, random generators)
used to be ``pickle.dumps`` bytes, unpickled on resume: a crafted checkpoint ran its code. Now it
is ``torch.save`` bytes of tensors and plain values, and DCP's non-tensor values load through a
planner that uses ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from d9d.loop.checkpoint._checkpointer import Checkpointer, CheckpointLoadError, CheckpointLocation
from d9d.loop.checkpoint._train_state import ObjectState, RandomState
from d9d.loop.checkpoint._weights_only_planner import WeightsOnlyLoadPlanner
from d9d.loop.config._trainer import CheckpointConfig
from d9d.mesh import DistributedContext, MeshParameters
from d9d.mesh.testing import run_distributed


class _RunsCode:
    """A pickle payload: unpickling it runs ``exec`` and writes the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _torch_saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _ignore(state: dict[str, Any]) -> None:
    del state


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _load_with_checkpointer(directory: str, state: dict[str, Any]) -> str | None:
    """Loads step 1 of ``directory`` into ``state`` through the Checkpointer; the error as text."""
    context = DistributedContext(MeshParameters(), device_type="cpu")
    checkpointer = Checkpointer(config=CheckpointConfig(directory=Path(directory)), dist_context=context)
    try:
        checkpointer.load(CheckpointLocation(step=1, path=Path(directory) / "step_000000001"), state)
    except (CheckpointLoadError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        context.close()
    return None


def _save_and_resume(directory: str) -> dict[str, Any]:
    """Saves RNG and trainer state, draws, restores them, draws again."""
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()  # move every generator off its seeded start
    position = {"step": 7, "data": {"epoch": 1, "index": [3, 5]}, "total_steps": None, "task": {}}
    restored: list[dict[str, Any]] = []
    state = {"trainer": ObjectState(lambda: position, restored.append), "rng_rank0": RandomState()}
    dcp.save(state, checkpoint_id=str(Path(directory) / "step_000000001"))
    before = _draws()
    error = _load_with_checkpointer(directory, state)
    return {"before": before, "after": _draws(), "restored": restored, "error": error}


def test_train_state_round_trips_bit_exact(tmp_path: Path) -> None:
    result = run_distributed(_save_and_resume, str(tmp_path), world_size=1)[0]
    assert result["error"] is None
    assert result["after"] == result["before"]  # Python, numpy and torch generators all restored
    assert result["restored"] == [
        {"step": 7, "data": {"epoch": 1, "index": [3, 5]}, "total_steps": None, "task": {}}
    ]


def test_saved_train_state_loads_with_weights_only(tmp_path: Path) -> None:
    # What d9d writes is itself loadable with torch.load(weights_only=True) (no pickle.dumps inside).
    random.seed(0)
    for name, saved in [
        (
            "trainer",
            ObjectState(lambda: {"step": 3, "lr_scheduler": {"last_epoch": 3}}, _ignore).state_dict(),
        ),
        ("rng", RandomState().state_dict()),
    ]:
        [payload] = saved.values()
        loaded = torch.load(io.BytesIO(payload), weights_only=True)
        assert isinstance(loaded, dict), name


def test_a_state_that_needs_pickle_is_refused_at_save_naming_its_key() -> None:
    state = ObjectState(lambda: {"step": 3, "task": {"seen": np.int64(4)}}, _ignore)
    with pytest.raises(TypeError, match=r"'task'.*numpy"):
        state.state_dict()


def _craft(directory: Path, layer: str, marker: Path) -> dict[str, Any]:
    """Writes step 1 whose train state carries a payload at ``layer``; returns the state to load into."""
    match layer:
        case "dcp_value":  # DCP's own torch.save of the state's bytes, replaced by the payload
            saved: dict[str, Any] = {"trainer": {"torch_save": _RunsCode(marker)}}
        case "state_bytes":  # well-formed DCP value whose torch.save bytes hold the payload
            saved = {"trainer": {"torch_save": _torch_saved({"step": _RunsCode(marker)})}}
        case "old_pickle":  # the layout d9d-loop 0.25 wrote: pickle.dumps bytes under "pickled"
            saved = {"trainer": {"pickled": pickle.dumps({"step": _RunsCode(marker)})}}
        case _:
            raise AssertionError(layer)
    dcp.save(saved, checkpoint_id=str(directory / "step_000000001"), no_dist=True)
    return {"trainer": ObjectState(lambda: {"step": 0}, _ignore)}


def _crafted_resume(directory: str, layer: str, marker: str) -> str | None:
    state = _craft(Path(directory), layer, Path(marker))
    return _load_with_checkpointer(directory, state)


@pytest.mark.parametrize(
    ("layer", "refusal"),
    [
        ("dcp_value", r"CheckpointLoadError: .*checkpoint value 'trainer.torch_save'.*weights_only=True"),
        (
            "state_bytes",
            r"CheckpointLoadError: .*the train state holds a value that loads only with full pickle",
        ),
        (
            "old_pickle",
            r"PickledTrainStateError: checkpoint .*step_000000001 stores its train state \(trainer.pickled\)",
        ),
    ],
)
def test_a_crafted_train_state_is_refused_and_never_run(tmp_path: Path, layer: str, refusal: str) -> None:
    marker = tmp_path / "ran"
    error = run_distributed(_crafted_resume, str(tmp_path / "ckpt"), layer, str(marker), world_size=1)[0]
    assert not marker.exists()  # the payload's code did not run
    assert error is not None
    assert re.search(refusal, error, flags=re.DOTALL), error


def test_the_old_pickle_refusal_says_how_to_go_on(tmp_path: Path) -> None:
    error = run_distributed(
        _crafted_resume, str(tmp_path / "ckpt"), "old_pickle", str(tmp_path / "ran"), world_size=1
    )[0]
    assert error is not None
    assert "d9d export" in error and "trainer.initialization.source" in error and "move" in error


def test_the_planner_refuses_a_payload_and_loads_plain_values(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    dcp.save({"extra": {"value": _RunsCode(marker)}}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    # DCP wraps the refusal in its CheckpointException (a BaseException)
    with pytest.raises(CheckpointException, match=r"'extra.value' .*weights_only=True.*GLOBAL exec"):
        dcp.load(
            {"extra": {"value": 0}},
            checkpoint_id=str(tmp_path / "c"),
            planner=WeightsOnlyLoadPlanner(),
            no_dist=True,
        )
    assert not marker.exists()
    # plain values (an optimizer's lr, a tuple of betas) still load
    dcp.save({"extra": {"lr": 0.5, "betas": (0.9, 0.99)}}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    target: dict[str, Any] = {"extra": {"lr": 0.0, "betas": (0.0, 0.0)}}
    dcp.load(target, checkpoint_id=str(tmp_path / "d"), planner=WeightsOnlyLoadPlanner(), no_dist=True)
    assert target == {"extra": {"lr": 0.5, "betas": (0.9, 0.99)}}
