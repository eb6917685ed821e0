"""Training metrics and evaluation during training: exact over ranks, under pipeline parallelism too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from loop_classification_job import (
    ClassifierTask,
    Points,
    StagedClassifier,
    StagedProvider,
    build_classifier_trainer,
    classification_config,
)
from safetensors.torch import save_file
from sklearn.metrics import f1_score, roc_auc_score

from d9d.loop import (
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    EventBus,
    StepFailedError,
    StepFinished,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed
from d9d.pipeline import PipelineStageInfo


def _run(mesh: dict[str, int], source: str, directory: str | None) -> dict[str, Any]:
    trainer_section: dict[str, Any] = {
        "initialization": {"source": source},
        "evaluation": {"every_steps": 2, "best": {"metric": "eval/auroc", "mode": "max"}},
    }
    if directory is not None:
        trainer_section["checkpoint"] = {"directory": directory, "every_steps": 100}
    config = classification_config(mesh=mesh, trainer=trainer_section)
    events = EventBus()
    records: list[dict[str, float]] = []
    events.subscribe(StepFinished, lambda e: records.append(dict(e.metrics)))
    trainer = build_classifier_trainer(config, events=events)
    trainer.train()
    params = {}
    if mesh == {}:
        params = {k: v.detach().clone() for k, v in trainer.model_stages[0].state_dict().items()}
    trainer.close()
    return {"records": records, "params": params}


def _reference(params: dict[str, torch.Tensor]) -> dict[str, float]:
    model = StagedClassifier(PipelineStageInfo(current_stage=0, num_stages=1))
    model.load_state_dict(params)
    data = Points(45, seed=1)
    with torch.no_grad():
        logits = model({"x": data.x}, None)
    return {
        "eval/loss": float(F.cross_entropy(logits, data.y)),
        "eval/accuracy": float((logits.argmax(-1) == data.y).double().mean()),
        "eval/auroc": float(roc_auc_score(data.y, logits.softmax(-1)[:, 1])),
        "eval/f1/f1": float(f1_score(data.y, logits.argmax(-1), average="macro")),
    }


def test_evaluation_under_pp2_x_dp2_matches_one_process_and_a_direct_computation(tmp_path: Path) -> None:
    torch.manual_seed(0)
    full = StagedClassifier(PipelineStageInfo(current_stage=0, num_stages=1))
    source = tmp_path / "init.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(source))
    single = run_distributed(_run, {}, str(source), str(tmp_path / "ckpt"), world_size=1)[0]
    records = single["records"]
    # training metrics ride along every logged step; evaluation at steps 2 and 4 only
    assert {"accuracy", "auroc", "f1/f1", "f1/precision", "f1/recall"} <= set(records[0])
    assert "eval/loss" not in records[0] and "eval/loss" in records[1] and "eval/loss" in records[3]
    # 45 held-out samples: two full global batches of 16 and one padded batch of 13
    for name, value in _reference(single["params"]).items():
        assert records[3][name] == pytest.approx(value, rel=1e-5), name
    assert records[3]["eval/auroc/best"] == max(records[1]["eval/auroc"], records[3]["eval/auroc"])
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    assert "step_000000002" in saved  # the first evaluation is a new best: checkpointed

    pipelined = run_distributed(
        _run,
        {"pipeline_parallel": 2, "data_parallel_shard": 2},
        str(source),
        None,
        world_size=4,
        timeout_s=240,
    )
    for result in pipelined:
        for step in (1, 3):
            for name in ("eval/loss", "eval/accuracy", "eval/auroc", "eval/f1/f1", "accuracy", "loss"):
                assert result["records"][step][name] == pytest.approx(records[step][name], rel=1e-4), name


def test_evaluation_without_data_is_refused_before_anything_starts() -> None:
    config = classification_config(trainer={"evaluation": {"every_steps": 2}})
    with pytest.raises(ValueError, match=r"trainer.evaluation is set but .* no evaluation_data="):
        TrainingConfigurator(
            mesh=config.mesh,
            parameters=config.trainer,
            model_provider=StagedProvider(),
            task_provider=lambda ctx: ClassifierTask(),
            data_provider=None,  # type: ignore[arg-type]
            optimizer_provider=AutoOptimizerProvider(config.optimizer),
            lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        )


class _KilledError(RuntimeError):
    """Stands in for a job killed mid-run."""


def _records_of_run(
    directory: str, *, kill_at: int | None = None
) -> tuple[list[dict[str, float]], float | None]:
    trainer_section: dict[str, Any] = {
        "max_steps": 8,
        "logging": {"progress_bar": False, "every_steps": 5},
        # "max" on a falling loss: the best is the first evaluation's, which a resumed run never sees.
        "evaluation": {"every_steps": 2, "best": {"metric": "eval/loss", "mode": "max"}},
        "checkpoint": {"directory": directory, "every_steps": 4},
    }
    events = EventBus()
    records: list[dict[str, float]] = []

    def record(event: StepFinished) -> None:
        records.append({"step": float(event.step), **event.metrics})
        if event.step == kill_at:
            raise _KilledError(f"killed after step {event.step}")

    events.subscribe(StepFinished, record)
    trainer = build_classifier_trainer(classification_config(trainer=trainer_section), events=events)
    if kill_at is None:
        trainer.train()
    else:
        with pytest.raises(StepFailedError, match="_KilledError: killed after step"):
            trainer.train()
    evaluator = trainer._p.evaluator  # pyright: ignore[reportPrivateUsage]
    best = evaluator.best if evaluator is not None else None
    trainer.close()
    return records, best


def _straight_and_resumed(straight_dir: str, resumed_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    straight, straight_best = _records_of_run(straight_dir)
    torch.manual_seed(0)
    # Killed during step 5: the last checkpoint (after step 3) is mid logging window (steps 1..5).
    first, first_best = _records_of_run(resumed_dir, kill_at=5)
    resumed, resumed_best = _records_of_run(resumed_dir)
    return {
        "straight": straight,
        "straight_best": straight_best,
        "first": first,
        "first_best": first_best,
        "resumed": resumed,
        "resumed_best": resumed_best,
    }


def test_best_so_far_and_the_training_metrics_window_survive_a_resume(tmp_path: Path) -> None:
    result = run_distributed(_straight_and_resumed, str(tmp_path / "a"), str(tmp_path / "b"), world_size=1)[0]
    straight = {int(r["step"]): r for r in result["straight"]}
    resumed = {int(r["step"]): r for r in result["resumed"]}
    assert sorted(resumed) == [4, 5, 6, 7]  # the second run continues from the checkpoint after step 3
    assert result["first_best"] == max(r["eval/loss"] for r in result["first"] if "eval/loss" in r)
    # The best so far is carried over: the resumed run's best is over the evaluations of both runs.
    assert result["resumed_best"] == result["straight_best"]
    for step in (5, 7):  # evaluations after the resume
        assert resumed[step]["eval/loss/best"] == straight[step]["eval/loss/best"]
    # No evaluation after the resume beat the saved best, so none was checkpointed as one (step 6).
    saved = sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_000000004", "step_000000008"]
    # Step 5 closes the logging window of steps 1..5, which straddles the resume.
    for name in ("accuracy", "auroc", "f1/f1", "loss"):
        assert resumed[5][name] == straight[5][name], name


def _saved_with_evaluation(directory: str, read_figures: str) -> list[str]:
    trainer_section: dict[str, Any] = {
        "max_steps": 6,
        # Only steps 0 and 5 log the training metrics: the others are read late when they may be.
        "logging": {"progress_bar": False, "every_steps": 100, "read_figures": read_figures},
        # "min" on a falling loss: every evaluation (after steps 2, 4, 6) is a new best and is saved.
        "evaluation": {"every_steps": 2, "best": {"metric": "eval/loss", "mode": "min"}},
        "checkpoint": {"directory": directory, "every_steps": 100, "keep_last": 10},
    }
    torch.manual_seed(0)
    trainer = build_classifier_trainer(classification_config(trainer=trainer_section))
    trainer.train()
    trainer.close()
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("step_"))


def test_a_best_evaluation_saves_once_when_figures_are_read_during_the_next_step(tmp_path: Path) -> None:
    saved = {
        mode: run_distributed(_saved_with_evaluation, str(tmp_path / mode), mode, world_size=1)[0]
        for mode in ("after_step", "during_next_step")
    }
    assert saved["after_step"] == ["step_000000002", "step_000000004", "step_000000006"]
    # The step after a best evaluation is read late and evaluates nothing: it saves nothing either.
    assert saved["during_next_step"] == saved["after_step"]
