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
