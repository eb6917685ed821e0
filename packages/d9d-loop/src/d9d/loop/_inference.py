"""The inference loop: a trained model over a data set, on any mesh, outputs to the task."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.loop._batch_layout import BatchLayout
from d9d.loop._model_provider import ModelProvider, StagesReadyContext
from d9d.loop._model_stage_factory import BuiltStage, ModelStageFactory
from d9d.loop._task import BuildForwardInputsContext, BuildForwardInputsResult
from d9d.loop.checkpoint._train_state import ModelState
from d9d.loop.checkpoint._weights_only_planner import WeightsOnlyLoadPlanner
from d9d.loop.config._trainer import InitializationConfig, NonEmptyPath
from d9d.loop.data._evaluation_data import (
    EvaluationData,
    first_rows,
    padded_batches,
    real_rows_per_microbatch,
)
from d9d.loop.evaluation._wiring import counts_metrics, forward_runner
from d9d.loop.peft import FullFineTuningConfig, LoRAConfig, PeftConfig
from d9d.loop.step._forward_runner import ForwardRunner
from d9d.mesh import DistributedContext, MeshParameters, map_tree, shard_tree
from d9d.pipeline import PipelineProgram, PipelineStageInfo, build_forward_only_program

BatchT = TypeVar("BatchT")
InputT = TypeVar("InputT")
SharedT = TypeVar("SharedT")
OutputT = TypeVar("OutputT")


class InferenceConfig(BaseModel):
    """An inference run.

    Attributes:
        global_batch_size: Samples per forward pass over all data-parallel ranks.
        microbatch_size: Samples per microbatch (pipeline parallelism overlaps microbatches).
        weights: A safetensors export (file or directory, read through the provider's state
            mapper) or a d9d checkpoint directory (``.../step_000000100``). None (``safetensors``
            only): the provider loads the weights itself in ``load_model_stage``, as d9d-hf's
            providers do when built from the export (``PretrainedModelConfig(source=<export
            dir>)``); a provider that loads nothing is then an error.
        weights_format: ``safetensors`` or ``checkpoint``.
        peft: The training run's ``peft`` (a checkpoint of a LoRA run holds its adapters).
        base_weights: With ``peft: {kind: lora}`` and a checkpoint: the base model's safetensors
            (read through the provider's state mapper), since a LoRA checkpoint holds only the
            adapters and trained extras; None when the provider loads its base itself.
        seed: Seed of anything random (dropout is off).
        device: ``auto``, ``cpu`` or ``cuda``.
        collective_seconds: Timeout of every collective operation (a hung rank ends the run
            with an error naming the collective instead of waiting forever).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    global_batch_size: int = Field(ge=1)
    microbatch_size: int = Field(ge=1)
    weights: NonEmptyPath | None = None
    weights_format: Literal["safetensors", "checkpoint"] = "safetensors"
    peft: PeftConfig = FullFineTuningConfig()
    base_weights: NonEmptyPath | None = None
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    collective_seconds: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _checkpoint_needs_weights(self) -> InferenceConfig:
        if self.weights_format == "checkpoint" and self.weights is None:
            raise ValueError("weights_format='checkpoint' needs weights: the checkpoint directory")
        return self


@dataclass(kw_only=True, frozen=True)
class ProcessOutputsContext(Generic[OutputT]):
    """One microbatch's outputs on the last stage, padding rows removed.

    Attributes:
        pipeline_results: The model's output for the microbatch's real samples.
        state: The matching rows of ``BuildForwardInputsResult.state`` (sample ids, say).
    """

    pipeline_results: OutputT
    state: Any


@dataclass(kw_only=True, frozen=True)
class InferenceFinishedContext:
    """Input of ``InferenceTask.finish``; ``writes`` is True on ranks whose outputs count."""

    dist_context: DistributedContext
    writes: bool


class InferenceTask(ABC, Generic[BatchT, InputT, SharedT, OutputT]):
    """What inference does: model inputs from a batch, and something with the outputs."""

    @abstractmethod
    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[BatchT]
    ) -> BuildForwardInputsResult[InputT, SharedT, Any]:
        """Model input and shared data; ``state`` travels to ``process_outputs`` row by row."""

    @abstractmethod
    def process_outputs(self, ctx: ProcessOutputsContext[OutputT]) -> None:
        """Consumes one microbatch's outputs (called only on ranks whose outputs count)."""

    def finish(self, ctx: InferenceFinishedContext) -> None:
        """After the pass (close files, say); does nothing by default."""
        del ctx


class Inference:
    """A configured inference run; ``run()`` passes the data once, ``close()`` releases the context."""

    def __init__(
        self,
        *,
        dist_context: DistributedContext,
        runner: ForwardRunner,
        task: InferenceTask[Any, Any, Any, Any],
        data: EvaluationData[Any, Any],
        layout: BatchLayout,
        writes: bool,
    ) -> None:
        self._dist = dist_context
        self._runner = runner
        self._task = task
        self._data = data
        self._layout = layout
        self._writes = writes

    def run(self) -> None:
        """Every sample once, over all ranks; outputs reach ``task.process_outputs`` in order per rank."""
        layout, device = self._layout, self._dist.device
        num_microbatches = layout.microbatches_per_step
        dataset = self._data.dataset_factory(self._dist)
        for index, padded in enumerate(
            padded_batches(
                self._data,
                dataset,
                local_batch_size=layout.local_batch_size,
                dp_rank=self._dist.data_parallel_rank,
                dp_size=layout.data_parallel_size,
            )
        ):
            moved = map_tree(padded.batch, lambda t, _p: t.to(device))
            built = self._task.build_forward_inputs(BuildForwardInputsContext(batch=moved, step=index))
            outputs = self._runner.forward(
                inputs=built.input, shared=built.shared, num_microbatches=num_microbatches
            )
            if outputs is None or not self._writes:
                continue
            states = shard_tree(built.state, num_shards=num_microbatches)
            rows = real_rows_per_microbatch(
                padded.real, local_batch_size=layout.local_batch_size, num_microbatches=num_microbatches
            )
            for output, state, real in zip(outputs, states, rows, strict=True):
                if real:
                    self._task.process_outputs(
                        ProcessOutputsContext(
                            pipeline_results=first_rows(output, real), state=first_rows(state, real)
                        )
                    )
        self._task.finish(InferenceFinishedContext(dist_context=self._dist, writes=self._writes))

    def close(self) -> None:
        """Releases the distributed context."""
        self._dist.close()

    def __enter__(self) -> Inference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InferenceConfigurator:
    """Builds an ``Inference``: context, stages (loaded weights), forward-only pipeline program.

    Args:
        mesh: Parallelism degrees (pipeline parallelism included).
        parameters: The run's settings.
        model_provider: The training run's provider (same stages, same parallelism).
        task: The inference task.
        data: The data set, read once in order.
    """

    def __init__(
        self,
        *,
        mesh: MeshParameters,
        parameters: InferenceConfig,
        model_provider: ModelProvider[Any],
        task: InferenceTask[Any, Any, Any, Any],
        data: EvaluationData[Any, Any],
    ) -> None:
        self._mesh = mesh
        self._config = parameters
        self._layout = BatchLayout.of(
            mesh, global_batch_size=parameters.global_batch_size, microbatch_size=parameters.microbatch_size
        )
        self._provider = model_provider
        self._task = task
        self._data = data

    def configure(self) -> Inference:
        """Starts the distributed context and loads the model."""
        config = self._config
        dist_context = DistributedContext(
            self._mesh,
            device_type=None if config.device == "auto" else config.device,
            timeout=timedelta(seconds=config.collective_seconds),
        )
        try:
            dist_context.seed(config.seed)
            stages = self._build_stages(dist_context)
            return Inference(
                dist_context=dist_context,
                runner=forward_runner(dist_context, self._program(), stages),
                task=self._task,
                data=self._data,
                layout=self._layout,
                writes=counts_metrics(dist_context, stages),
            )
        except BaseException:
            dist_context.close()
            raise

    def _program(self) -> PipelineProgram | None:
        ranks = self._mesh.pipeline_parallel
        if ranks == 1:
            return None
        return build_forward_only_program(
            num_ranks=ranks, num_microbatches=self._layout.microbatches_per_step
        )

    def _build_stages(self, dist_context: DistributedContext) -> list[BuiltStage[Any]]:
        config = self._config
        program = self._program()
        infos = (
            program.stage_infos(dist_context.pipeline_rank)
            if program is not None
            else [PipelineStageInfo(current_stage=0, num_stages=1)]
        )
        from_export = config.weights_format == "safetensors"
        factory = ModelStageFactory(
            provider=self._provider,
            dist_context=dist_context,
            config=InitializationConfig(source=config.weights if from_export else config.base_weights),
            seed=config.seed,
            peft=config.peft,
        )
        stages = [factory.build(info, keep_meta_copy=program is not None) for info in infos]
        if config.weights is None and not all(s.loaded_by_provider for s in stages):
            raise ValueError(
                f"InferenceConfig.weights is unset but {type(self._provider).__name__}.load_model_stage "
                f"loaded no weights: set weights, or build the provider from the export (d9d-hf: "
                f"PretrainedModelConfig(source=<export dir>))"
            )
        if not from_export:
            assert config.weights is not None  # the config's validator
            dcp.load(
                {
                    "model": ModelState(
                        [s.model for s in stages], trainable_only=isinstance(config.peft, LoRAConfig)
                    )
                },
                checkpoint_id=str(Path(config.weights)),
                planner=WeightsOnlyLoadPlanner(),
            )
        # As in training: collective on every rank (e.g. a tied head takes the first stage's embedding).
        self._provider.stages_ready(
            StagesReadyContext(dist_context=dist_context, stages=[(s.stage, s.model) for s in stages])
        )
        return stages
