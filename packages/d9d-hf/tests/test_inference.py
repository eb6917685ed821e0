"""Inference from a safetensors export of a Qwen3 run: the provider is built from the export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.hf import (
    DecoderInputs,
    DecoderModel,
    HFModelProvider,
    PretrainedModelConfig,
    TokenBatch,
    TokenSample,
    causal_lm_targets,
    causal_lm_task,
)
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    EvaluationData,
    InferenceConfig,
    InferenceConfigurator,
    InferenceTask,
    ProcessOutputsContext,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.mesh import MeshParameters
from d9d.mesh.testing import run_distributed

SEQ = 16


class _Rows:
    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, 128, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> TokenSample:
        return TokenSample(input_ids=self.ids[index], labels=self.ids[index].clone())


class _TokenLosses(InferenceTask[TokenBatch, DecoderInputs, None, torch.Tensor]):
    """Per-token losses of each row, in order."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[TokenBatch]
    ) -> BuildForwardInputsResult[DecoderInputs, None, torch.Tensor]:
        ids = ctx.batch.input_ids
        inputs = DecoderInputs(input_ids=ids, labels=causal_lm_targets(ids))
        return BuildForwardInputsResult(input=inputs, shared=None, state=ids)

    def process_outputs(self, ctx: ProcessOutputsContext[torch.Tensor]) -> None:
        self.losses.append(ctx.pipeline_results.detach().reshape(ctx.state.shape[0], -1).clone())


def _train_and_export(source: str, export: str, probe: torch.Tensor) -> torch.Tensor:
    config = ProjectConfig.model_validate(
        {
            "trainer": {
                "max_steps": 3,
                "global_batch_size": 8,
                "microbatch_size": 4,
                "logging": {"progress_bar": False},
                "device": "cpu",
            },
            "optimizer": {"name": "adamw", "lr": 0.01},
        }
    )
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(PretrainedModelConfig(source=source, attention_backend="eager")),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Rows(16, seed=3), collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    with trainer:
        trainer.train()
        trainer.export(export)
        model = trainer.model_stages[0]
        assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
        model.eval()
        with torch.no_grad():
            losses = model(DecoderInputs(input_ids=probe, labels=causal_lm_targets(probe)))
    assert isinstance(losses, torch.Tensor)
    return losses.reshape(probe.shape[0], -1)


def _infer(export: str, weights: str | None) -> torch.Tensor:
    task = _TokenLosses()
    with InferenceConfigurator(
        mesh=MeshParameters(),
        parameters=InferenceConfig(global_batch_size=4, microbatch_size=2, weights=weights, device="cpu"),
        model_provider=HFModelProvider(PretrainedModelConfig(source=export, attention_backend="eager")),
        task=task,
        data=EvaluationData(dataset_factory=lambda _: _Rows(6, seed=9), collator=TokenBatch.collate),
    ).configure() as inference:
        inference.run()
    return torch.cat(task.losses)


def _run(source: str, export: str) -> dict[str, Any]:
    trained = _train_and_export(source, export, _Rows(6, seed=9).ids)
    inferred = _infer(export, None)
    with pytest.raises(ValueError, match=r"loads the model from its own source; set only one .* leave"):
        _infer(export, export)  # both: the refusal says how to do it
    return {"trained": trained, "inferred": inferred}


def test_inference_from_a_safetensors_export_gives_the_trained_model_s_outputs(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    result = run_distributed(_run, str(checkpoints["dense"]), str(tmp_path / "export"), world_size=1)[0]
    assert result["inferred"].shape == result["trained"].shape == (6, SEQ)
    torch.testing.assert_close(result["inferred"], result["trained"], rtol=1e-6, atol=1e-6)
