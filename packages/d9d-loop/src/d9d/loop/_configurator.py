"""The composition root: wires every part of a training job, explicitly, in one place."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from d9d.loop._auto_data import AutoDataProvider
from d9d.loop._checkpointer import Checkpointer
from d9d.loop._config_project import check_batch_layout
from d9d.loop._config_trainer import TrainerConfig
from d9d.loop._directory_checks import estimate_checkpoint_bytes
from d9d.loop._events import ConfigReady, EventBus, ModelReady
from d9d.loop._gradient_manager import GradientManager
from d9d.loop._model_provider import ModelProvider
from d9d.loop._model_stage_factory import ModelStageFactory
from d9d.loop._pipelined_step_runner import PipelinedStepRunner, PipelineStageAdapter
from d9d.loop._providers import (
    DataProvider,
    DataProviderContext,
    LRSchedulerProvider,
    LRSchedulerProviderContext,
    OptimizerProvider,
    OptimizerProviderContext,
)
from d9d.loop._step_runner import SequentialStepRunner, StepRunner
from d9d.loop._task import TaskProviderContext, TrainTask
from d9d.loop._trackers import NoTracker, Tracker, build_tracker
from d9d.loop._trainer import Trainer, TrainerParts
from d9d.mesh import BATCH_DOMAIN, FLAT_DOMAIN, DistributedContext, MeshParameters
from d9d.pipeline import PipelineExecutor, PipelineStageInfo, build_program, stages_for_rank

TaskProvider = Callable[[TaskProviderContext], TrainTask[Any, Any, Any, Any, Any]]


class TrainingConfigurator:
    """Builds a ``Trainer`` from configuration and the user's providers.

    Everything is validated before any process group starts: the batch layout against the mesh,
    and the mesh against the world size.

    Args:
        mesh: Parallelism degrees.
        parameters: The trainer section of the config.
        model_provider: Builds, parallelizes and exports model stages.
        task_provider: Builds the task (called once the distributed context exists).
        data_provider: Builds this rank's batch source (e.g. ``AutoDataProvider``).
        optimizer_provider: Builds the optimizer (e.g. ``AutoOptimizerProvider``).
        lr_scheduler_provider: Builds the LR scheduler (e.g. ``AutoLRSchedulerProvider``).
        events: An event bus with the caller's subscriptions (a new one when None).
        tracker: Overrides the tracker named by ``parameters.logging.tracker``.
    """

    def __init__(
        self,
        *,
        mesh: MeshParameters,
        parameters: TrainerConfig,
        model_provider: ModelProvider[Any],
        task_provider: TaskProvider,
        data_provider: DataProvider[Any] | AutoDataProvider[Any, Any],
        optimizer_provider: OptimizerProvider,
        lr_scheduler_provider: LRSchedulerProvider,
        events: EventBus | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        check_batch_layout(mesh, parameters)
        self._mesh = mesh
        self._config = parameters
        self._model_provider = model_provider
        self._task_provider = task_provider
        self._data_provider = data_provider
        self._optimizer_provider = optimizer_provider
        self._lr_scheduler_provider = lr_scheduler_provider
        self._events = events or EventBus()
        self._tracker = tracker

    def configure(self) -> Trainer:
        """Starts the distributed context, builds the model and every component, returns the trainer."""
        config = self._config
        dist_context = DistributedContext(
            self._mesh,
            device_type=None if config.device == "auto" else config.device,
            timeout=timedelta(seconds=config.timeouts.collective_seconds),
        )
        dist_context.seed(config.seed)
        self._events.publish(ConfigReady(dist_context=dist_context))

        pipelined = self._mesh.pipeline_parallel > 1
        stage_infos = (
            stages_for_rank(
                config.pipeline, num_ranks=self._mesh.pipeline_parallel, rank=dist_context.pipeline_rank
            )
            if pipelined
            else [PipelineStageInfo(current_stage=0, num_stages=1)]
        )
        factory = ModelStageFactory(
            provider=self._model_provider,
            dist_context=dist_context,
            config=config.initialization,
            seed=config.seed,
        )
        stages = [factory.build(info, keep_meta_copy=pipelined) for info in stage_infos]
        models = [s.model for s in stages]
        self._events.publish(ModelReady(model_stages=tuple(models)))

        batch_mesh = dist_context.mesh_for(BATCH_DOMAIN)
        dp_size = self._mesh.data_parallel
        local_batch = config.global_batch_size // dp_size
        batches = self._data_provider.build(
            DataProviderContext(
                dist_context=dist_context,
                global_batch_size=config.global_batch_size,
                local_batch_size=local_batch,
                dp_rank=dist_context.data_parallel_rank,
                dp_size=dp_size,
            )
        )
        total_steps = (
            config.max_steps
            if config.max_steps is not None
            else (config.epochs or 1) * batches.steps_per_epoch
        )
        task = self._task_provider(TaskProviderContext(dist_context=dist_context))
        optimizer = self._optimizer_provider.build(
            OptimizerProviderContext(dist_context=dist_context, model_stages=models)
        )
        lr_scheduler = self._lr_scheduler_provider.build(
            LRSchedulerProviderContext(
                dist_context=dist_context, optimizer=optimizer, total_steps=total_steps
            )
        )
        gradients = GradientManager(
            stages=models,
            data_parallel_size=dp_size,
            bucket_size_mb=config.gradient_bucket_size_mb,
            clipping=config.gradient_clipping,
            pp_group=batch_mesh.get_group("pp") if self._mesh.pipeline_parallel > 1 else None,
        )
        microbatches = local_batch // config.microbatch_size
        step_runner: StepRunner
        if pipelined:
            adapters: dict[int, PipelineStageAdapter] = {}
            for s in stages:
                if s.meta_model is None:  # built with keep_meta_copy=pipelined above
                    raise RuntimeError(f"stage {s.stage.current_stage} was built without its meta copy")
                adapters[s.stage.current_stage] = PipelineStageAdapter(
                    s.model, s.meta_model, is_first=s.stage.is_first
                )
            executor = PipelineExecutor(
                build_program(
                    config.pipeline, num_ranks=self._mesh.pipeline_parallel, num_microbatches=microbatches
                ),
                adapters,
                group=batch_mesh.get_group("pp"),
                device=dist_context.device,
            )
            step_runner = PipelinedStepRunner(
                executor=executor,
                adapters=list(adapters.values()),
                stage_positions={s.stage.current_stage: i for i, s in enumerate(stages)},
                task=task,
                gradients=gradients,
            )
        else:
            step_runner = SequentialStepRunner(model=models[0], task=task, gradients=gradients)
        checkpointer = (
            Checkpointer(
                config=config.checkpoint,
                dist_context=dist_context,
                expected_bytes=estimate_checkpoint_bytes(models, optimizer),
            )
            if config.checkpoint.directory is not None
            else None
        )
        tracker = self._tracker or (
            build_tracker(config.logging.tracker) if dist_context.is_main_process else NoTracker()
        )
        return Trainer(
            TrainerParts(
                dist_context=dist_context,
                config=config,
                provider=self._model_provider,
                stages=stages,
                task=task,
                batches=batches,
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                gradients=gradients,
                step_runner=step_runner,
                checkpointer=checkpointer,
                tracker=tracker,
                events=self._events,
                total_steps=total_steps,
                microbatches_per_step=microbatches,
                loss_group=dist_context.mesh_for(FLAT_DOMAIN).get_group("world"),
                loss_replication=self._mesh.tensor_parallel * self._mesh.context_parallel,
            )
        )
