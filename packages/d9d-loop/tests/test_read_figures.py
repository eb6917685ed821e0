"""``trainer.logging.read_figures: during_next_step``: the same run, its figures one step later.

The host reads a step's loss, gradient norm and token count once the next step's forward and
backward are queued, so the device has work while the host waits. Everything the run computes
and reports must stay as with ``after_step``: losses, norms, logged metrics, parameters, the
non-finite policies and checkpoints; only when events arrive changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from loop_toy_job import build_trainer, toy_config
from pydantic import ValidationError
from recovery_helpers import checkpoints, run_toy

from d9d.loop import (
    EventBus,
    ForwardBackwardStarted,
    OptimizerStepStarted,
    StepFinished,
    StepStarted,
    TrainingFinished,
)
from d9d.mesh.testing import run_distributed

LATE: dict[str, Any] = {"read_figures": "during_next_step"}
TIMING = ("time/", "samples_per_s", "tokens_per_s", "mfu", "memory/")


def _logged(directory: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in line.items() if not any(k.startswith(prefix) for prefix in TIMING)}
        for line in lines
    ]


def _train(directory: str, read_figures: str, mesh: dict[str, int]) -> dict[str, Any]:
    logging: dict[str, Any] = {
        "progress_bar": False,
        "read_figures": read_figures,
        "tracker": {"name": "jsonl", "path": str(Path(directory) / "metrics.jsonl")},
    }
    config = toy_config(
        mesh=mesh,
        trainer={
            "max_steps": 7,
            "logging": logging,
            "checkpoint": {"directory": str(Path(directory) / "checkpoints"), "every_steps": 3},
        },
    )
    events = EventBus()
    order: list[tuple[str, int]] = []
    for kind in (StepStarted, ForwardBackwardStarted, OptimizerStepStarted, StepFinished, TrainingFinished):
        events.subscribe(
            kind, lambda e: order.append((type(e).__name__, getattr(e, "step", getattr(e, "steps", -1))))
        )
    trainer = build_trainer(config, events=events, strategy="fsdp")
    trainer.train()
    params = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in trainer.model_stages[0].named_parameters()
    }
    trainer.close()
    return {"order": order, "params": params}


@pytest.mark.parametrize("mesh", [{}, {"data_parallel_shard": 2}], ids=["one_rank", "dp_shard2"])
def test_reading_during_the_next_step_reports_and_trains_the_same_run(
    tmp_path: Path, mesh: dict[str, int]
) -> None:
    world = mesh.get("data_parallel_shard", 1)
    results = {
        mode: run_distributed(_train, str(tmp_path / mode), mode, mesh, world_size=world)[0]
        for mode in ("after_step", "during_next_step")
    }
    after, late = results["after_step"], results["during_next_step"]
    assert _logged(tmp_path / "during_next_step") == _logged(tmp_path / "after_step")
    for name, value in after["params"].items():
        assert late["params"][name].equal(value), name
    assert checkpoints(tmp_path / "during_next_step" / "checkpoints") == checkpoints(
        tmp_path / "after_step" / "checkpoints"
    )

    order = late["order"]
    # step 0's figures arrive during step 1, after its forward and backward were queued
    assert order.index(("StepFinished", 0)) > order.index(("ForwardBackwardStarted", 1))
    assert order.index(("StepFinished", 0)) < order.index(("OptimizerStepStarted", 1))
    # step 2 saves checkpoint step_3 and step 6 ends the run: both are read at their own end
    assert order.index(("StepFinished", 2)) < order.index(("StepStarted", 3))
    assert order[-2:] == [("StepFinished", 6), ("TrainingFinished", 7)]
    assert [s for kind, s in order if kind == "StepFinished"] == list(range(7))
    # with after_step every step ends before the next starts
    after_order = after["order"]
    for step in range(6):
        assert after_order.index(("StepFinished", step)) < after_order.index(("StepStarted", step + 1))


def _diverging(directory: Path, mode: str, policy: dict[str, Any]) -> dict[str, Any]:
    result = run_distributed(
        run_toy,
        str(directory / mode),
        max_steps=10,
        trainer={
            "gradient_clipping": {"max_norm": None},
            "nonfinite": policy,
            "logging": {"progress_bar": False, "read_figures": mode},
        },
        checkpoint={"every_steps": 3},  # steps 2, 5, 8 are read at their end, the others late
        optimizer={"name": "sgd", "lr": 1e4},
        world_size=1,
    )[0]
    result["warnings"] = [w.replace(str(directory / mode), "<dir>") for w in result["warnings"]]
    if result["error"] is not None:  # it names the checkpoint the run resumed from
        result["error"] = result["error"].replace(str(directory / mode), "<dir>")
    return result


@pytest.mark.parametrize(
    "policy", [{"policy": "rollback", "max_rollbacks": 2}, {"policy": "stop"}], ids=["rollback", "stop"]
)
def test_a_non_finite_step_read_during_the_next_one_ends_as_when_read_at_its_end(
    tmp_path: Path, policy: dict[str, Any]
) -> None:
    after = _diverging(tmp_path, "after_step", policy)
    late = _diverging(tmp_path, "during_next_step", policy)
    error = after["error"]
    assert error is not None and error.startswith("NonFiniteError: step "), error
    failed = int(error.split()[2].rstrip(":"))
    assert (failed + 1) % 3 != 0  # a step whose figures the next step reads
    assert late["error"] == error
    assert late["warnings"] == after["warnings"]
    assert late["losses"] == after["losses"]
    assert late["lrs"] == after["lrs"]
    saved = checkpoints(tmp_path / "after_step")
    assert saved and checkpoints(tmp_path / "during_next_step") == saved
    assert max(int(name.removeprefix("step_")) for name in saved) <= failed  # none after the bad step


def test_skip_cannot_wait_for_the_next_step() -> None:
    assert toy_config().trainer.logging.read_figures == "after_step"
    with pytest.raises(ValidationError, match=r"read_figures=during_next_step .*nonfinite.policy=skip"):
        toy_config(trainer={"logging": LATE, "nonfinite": {"policy": "skip"}})


def _sleep_from_a_late_event() -> str:
    config = toy_config(trainer={"max_steps": 4, "logging": {"progress_bar": False, **LATE}})
    events = EventBus()
    trainer = build_trainer(config, events=events)
    events.subscribe(StepFinished, lambda _e: trainer.sleep())
    try:
        trainer.train()
    except Exception as e:
        return str(e)
    finally:
        trainer.close()
    return ""


def test_sleep_from_an_event_read_during_the_next_step_is_refused() -> None:
    message = run_distributed(_sleep_from_a_late_event, world_size=1)[0]
    assert "sleep() was called during step 1 (from an event of step 0" in message, message


def _fail_in_step(step: int) -> list[tuple[str, int]]:
    config = toy_config(trainer={"max_steps": 6, "logging": {"progress_bar": False, **LATE}})
    events = EventBus()
    seen: list[tuple[str, int]] = []
    trainer = build_trainer(config, events=events)

    def started(event: StepStarted) -> None:
        seen.append(("StepStarted", event.step))
        if event.step == step:
            raise RuntimeError("the data service went away")

    events.subscribe(StepStarted, started)
    events.subscribe(StepFinished, lambda e: seen.append(("StepFinished", e.step)))
    try:
        trainer.train()
    except Exception as e:
        seen.append((f"{type(e).__name__}: {e}", -1))
    finally:
        trainer.close()
    return seen


def test_a_failing_step_reports_the_previous_step_before_the_error() -> None:
    # step 2's figures were to be read during step 3, which fails before it gets there
    seen = run_distributed(_fail_in_step, 3, world_size=1)[0]
    assert seen[-3:] == [
        ("StepStarted", 3),
        ("StepFinished", 2),
        ("StepFailedError: step 3 failed on rank 0: RuntimeError: the data service went away", -1),
    ], seen
