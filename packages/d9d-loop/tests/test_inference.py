"""The inference loop: from a d9d checkpoint or a safetensors export, PP=2 x DP=2 equals one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loop_classification_job import (
    Batch,
    Points,
    StagedProvider,
    build_classifier_trainer,
    classification_config,
    collate,
)

from d9d.loop import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    EvaluationData,
    InferenceConfig,
    InferenceConfigurator,
    InferenceTask,
    ProcessOutputsContext,
)
from d9d.mesh import MeshParameters
from d9d.mesh.testing import run_distributed


class Scores(InferenceTask[Batch, dict[str, torch.Tensor], None, torch.Tensor]):
    def __init__(self) -> None:
        self.rows: list[tuple[float, int]] = []

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[Batch]
    ) -> BuildForwardInputsResult[dict[str, torch.Tensor], None, torch.Tensor]:
        return BuildForwardInputsResult(input={"x": ctx.batch.x}, shared=None, state=ctx.batch.y)

    def process_outputs(self, ctx: ProcessOutputsContext[torch.Tensor]) -> None:
        probability = ctx.pipeline_results.softmax(-1)[:, 1]
        self.rows += zip(probability.tolist(), ctx.state.tolist(), strict=True)


def _train(directory: str, export: str) -> None:
    config = classification_config(trainer={"checkpoint": {"directory": directory}, "max_steps": 2})
    trainer = build_classifier_trainer(config)
    trainer.train()
    trainer.export(export)
    trainer.close()


def _infer(mesh: dict[str, int], weights: str, weights_format: str) -> list[tuple[float, int]]:
    task = Scores()
    with InferenceConfigurator(
        mesh=MeshParameters(**mesh),
        parameters=InferenceConfig(
            global_batch_size=8,
            microbatch_size=2,
            weights=weights,
            weights_format=weights_format,
            device="cpu",
        ),
        model_provider=StagedProvider(),
        task=task,
        data=EvaluationData(dataset_factory=lambda d: Points(45, seed=1), collator=collate),
    ).configure() as inference:
        inference.run()
    return task.rows


def test_inference_from_checkpoint_and_export_under_pp2_x_dp2_matches_one_process(tmp_path: Path) -> None:
    export = str(tmp_path / "export")
    run_distributed(_train, str(tmp_path / "ckpt"), export, world_size=1)
    checkpoint = str(tmp_path / "ckpt" / "step_000000002")
    single = run_distributed(_infer, {}, checkpoint, "checkpoint", world_size=1)[0]
    assert len(single) == 45 and [y for _, y in single] == Points(45, seed=1).y.tolist()
    exported = run_distributed(_infer, {}, export, "safetensors", world_size=1)[0]
    torch.testing.assert_close(torch.tensor(exported), torch.tensor(single))
    mesh = {"pipeline_parallel": 2, "data_parallel_shard": 2}
    ranks = run_distributed(_infer, mesh, checkpoint, "checkpoint", world_size=4, timeout_s=240)
    rows = sorted(row for rank_rows in ranks for row in rank_rows)  # the last stage's two dp ranks
    torch.testing.assert_close(torch.tensor(rows), torch.tensor(sorted(single)))


def _infer_without_weights() -> None:
    with pytest.raises(
        ValueError, match=r"InferenceConfig.weights is unset but StagedProvider.load_model_stage "
    ):
        InferenceConfigurator(
            mesh=MeshParameters(),
            parameters=InferenceConfig(global_batch_size=8, microbatch_size=2, device="cpu"),
            model_provider=StagedProvider(),  # loads nothing itself
            task=Scores(),
            data=EvaluationData(dataset_factory=lambda d: Points(4, seed=1), collator=collate),
        ).configure()


def test_unset_weights_need_a_provider_that_loads_them() -> None:
    with pytest.raises(ValueError, match=r"weights_format='checkpoint' needs weights"):
        InferenceConfig(global_batch_size=8, microbatch_size=2, weights_format="checkpoint")
    run_distributed(_infer_without_weights, world_size=1)  # never silently random weights


def test_collective_timeout_is_configured_and_validated() -> None:
    assert InferenceConfig(global_batch_size=8, microbatch_size=2).collective_seconds == 600.0
    assert (
        InferenceConfig(global_batch_size=8, microbatch_size=2, collective_seconds=30).collective_seconds
        == 30
    )
    with pytest.raises(ValueError, match="collective_seconds"):
        InferenceConfig(global_batch_size=8, microbatch_size=2, collective_seconds=0)
