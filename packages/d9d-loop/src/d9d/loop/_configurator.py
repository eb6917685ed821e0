"""The composition root: wires every part of a training job, explicitly, in a few short steps."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from d9d.loop._batch_layout import BatchLayout
from d9d.loop._events import ConfigReady, EventBus, ModelReady
from d9d.loop._model_provider import ModelProvider, StagesReadyContext, StagesReadyResult
from d9d.loop._model_stage_factory import BuiltStage, ModelStageFactory
from d9d.loop._providers import (
    BatchSource,
    DataProvider,
    DataProviderContext,
    LRSchedulerProvider,
    LRSchedulerProviderContext,
    OptimizerProvider,
    OptimizerProviderContext,
)
from d9d.loop._task import TaskFactory, TaskProvider, TaskProviderContext, TrainTask
from d9d.loop._trainer import RunPlan, Trainer, TrainerParts
from d9d.loop.checkpoint._checkpointer import Checkpointer, complete_checkpoints
from d9d.loop.checkpoint._directory_checks import estimate_checkpoint_bytes
from d9d.loop.checkpoint._lock import CheckpointLock, lock_checkpoint_directory
from d9d.loop.checkpoint._resume import describe_missing_step
from d9d.loop.config._rank_agreement import check_ranks_agree
from d9d.loop.config._trainer import TrainerConfig
from d9d.loop.data._auto_data import AutoDataProvider
from d9d.loop.data._evaluation_data import EvaluationData
from d9d.loop.estimate import device_budget_bytes
from d9d.loop.estimate._configure import check_memory_at_configure
from d9d.loop.evaluation._wiring import wire_metrics
from d9d.loop.export._exporter import ModelExporter
from d9d.loop.observability._run_instruments import build_run_instruments
from d9d.loop.observability._run_metadata import run_metadata
from d9d.loop.observability._tracker_group import build_trackers
from d9d.loop.observability._trackers import NoTracker, Tracker
from d9d.loop.peft import LoRAConfig, refuse_quantized_base_on_mesh
from d9d.loop.step._gradient_manager import GradientManager
from d9d.loop.step._nonfinite_guard import NonFiniteGuard
from d9d.loop.step._pipelined_runner import PipelinedStepRunner, PipelineStageAdapter
from d9d.loop.step._runner import SequentialStepRunner, StepRunner
from d9d.mesh import DistributedContext, MeshParameters
from d9d.pipeline import PipelineExecutor, PipelineProgram, PipelineScheduleBuilder, PipelineStageInfo


class TrainingConfigurator:
    """Builds a ``Trainer`` from configuration and the user's providers.

    Everything is validated before any process group starts: the batch layout against the mesh,
    and the mesh against the world size.

    Ownership: given ``mesh`` (parallelism degrees), ``configure()`` creates the distributed
    context and the trainer owns it (``Trainer.close()``, a ``with`` block, or interpreter exit
    releases it). Given ``dist_context``, the caller owns it and closes it.

    Args:
        mesh: Parallelism degrees (exactly one of ``mesh`` and ``dist_context``).
        parameters: The trainer section of the config.
        model_provider: Builds, parallelizes and exports model stages.
        task_provider: Builds the task (called once the distributed context exists): an object
            with ``build(context)`` or a plain function of the context.
        data_provider: Builds this rank's batch source (e.g. ``AutoDataProvider``).
        optimizer_provider: Builds the optimizer (e.g. ``AutoOptimizerProvider``).
        lr_scheduler_provider: Builds the LR scheduler (e.g. ``AutoLRSchedulerProvider``).
        events: An event bus with the caller's subscriptions (a new one when None).
        tracker: Overrides the tracker named by ``parameters.logging.tracker`` (any object that
            fits the ``Tracker`` protocol).
        dist_context: A distributed context the caller created and keeps owning.
        pipeline_schedule: Overrides ``parameters.pipeline``: any ``PipelineScheduleBuilder``
            (a user's own schedule) or a ready ``PipelineProgram``.
        evaluation_data: The held-out data of ``parameters.evaluation``.
    """

    def __init__(
        self,
        *,
        mesh: MeshParameters | None = None,
        parameters: TrainerConfig,
        model_provider: ModelProvider[Any],
        task_provider: TaskProvider | TaskFactory,
        data_provider: DataProvider[Any] | AutoDataProvider[Any, Any],
        optimizer_provider: OptimizerProvider,
        lr_scheduler_provider: LRSchedulerProvider,
        events: EventBus | None = None,
        tracker: Tracker | None = None,
        dist_context: DistributedContext | None = None,
        pipeline_schedule: PipelineScheduleBuilder | PipelineProgram | None = None,
        evaluation_data: EvaluationData[Any, Any] | None = None,
    ) -> None:
        if (mesh is None) == (dist_context is None):
            raise ValueError("TrainingConfigurator needs exactly one of mesh= and dist_context=")
        self._mesh = mesh if mesh is not None else _context_mesh(dist_context)
        refuse_quantized_base_on_mesh(self._mesh, parameters.peft)  # before any process group or weight
        self._layout = BatchLayout.of(
            self._mesh,
            global_batch_size=parameters.global_batch_size,
            microbatch_size=parameters.microbatch_size,
        )
        self._given_context = dist_context
        self._config = parameters
        self._model_provider = model_provider
        self._task_provider = task_provider
        self._data_provider = data_provider
        self._optimizer_provider = optimizer_provider
        self._lr_scheduler_provider = lr_scheduler_provider
        self._events = events or EventBus()
        self._tracker = tracker
        self._schedule: PipelineScheduleBuilder | PipelineProgram = pipeline_schedule or parameters.pipeline
        if parameters.evaluation is not None and evaluation_data is None:
            raise ValueError("trainer.evaluation is set but TrainingConfigurator got no evaluation_data=")
        self._evaluation_data = evaluation_data

    def configure(self) -> Trainer:
        """Starts (or borrows) the distributed context, builds every component, returns the trainer."""
        dist_context, owns_context = self._build_context()
        lock: CheckpointLock | None = None
        try:
            # before any work: ranks started with other settings, and a directory another job
            # holds, are refused on every rank
            check_ranks_agree(
                {"mesh": dist_context.parameters, "trainer": self._config}, group=dist_context.world_group()
            )
            lock = self._lock_checkpoints(dist_context)
            return self._build_trainer(dist_context, owns_context, lock)
        except BaseException:
            if lock is not None:
                lock.release()
            if owns_context:
                dist_context.close()
            raise

    def _build_context(self) -> tuple[DistributedContext, bool]:
        config = self._config
        if self._given_context is not None:
            dist_context, owns = self._given_context, False
            dist_context.set_timeout(timedelta(seconds=config.timeouts.collective_seconds))
        else:
            dist_context, owns = (
                DistributedContext(
                    self._mesh,
                    device_type=None if config.device == "auto" else config.device,
                    timeout=timedelta(seconds=config.timeouts.collective_seconds),
                ),
                True,
            )
        dist_context.seed(config.seed)
        self._events.publish(ConfigReady(dist_context=dist_context))
        return dist_context, owns

    def _lock_checkpoints(self, dist_context: DistributedContext) -> CheckpointLock | None:
        directory = self._config.checkpoint.directory
        if directory is None:
            return None
        group = dist_context.world_group()

        def broadcast(problem: str | None) -> str | None:
            box: list[str | None] = [problem]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            return box[0]

        lock = lock_checkpoint_directory(directory, dist_context=dist_context, broadcast=broadcast)
        resume = self._config.checkpoint.resume_options
        if resume is not None and resume.from_step is not None:
            on_disk = complete_checkpoints(directory) if dist_context.is_main_process else []
            missing = all(c.step != resume.from_step for c in on_disk)
            problem = describe_missing_step(resume.from_step, on_disk) if missing else None
            problem = broadcast(problem)
            if problem is not None:
                lock.release()
                raise ValueError(problem)
        return lock

    def _build_trainer(
        self, dist_context: DistributedContext, owns_context: bool, lock: CheckpointLock | None
    ) -> Trainer:
        config, layout = self._config, self._layout
        program = self._build_program()
        self._check_memory(dist_context)  # before any weight loads
        stages, ready = self._build_model(dist_context, program)
        models = [s.model for s in stages]
        batches = self._build_data(dist_context)
        total_steps = config.max_steps or (config.epochs or 1) * batches.steps_per_epoch
        task = _task_of(self._task_provider, TaskProviderContext(dist_context=dist_context))
        wired = wire_metrics(
            task=task,
            config=config.evaluation,
            data=self._evaluation_data,
            dist_context=dist_context,
            program=program,
            stages=stages,
            layout=layout,
            total_steps=total_steps,
        )
        optimizer, lr_scheduler = self._build_optimization(dist_context, models, total_steps)
        gradients = self._build_gradients(dist_context, program, models, ready)
        return Trainer(
            TrainerParts(
                dist_context=dist_context,
                owns_context=owns_context,
                plan=self._build_plan(total_steps),
                provider=self._model_provider,
                stages=stages,
                task=task,
                batches=batches,
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                gradients=gradients,
                step_runner=self._build_step_runner(
                    dist_context, program, stages, wired.step_task, gradients
                ),
                train_metrics=wired.train_metrics,
                evaluator=wired.evaluator,
                checkpointer=self._build_checkpointer(dist_context, models, optimizer, lock),
                exporter=self._build_exporter(dist_context, stages),
                tracker=self._build_tracker(dist_context),
                instruments=build_run_instruments(
                    config, dist_context=dist_context, provider=self._model_provider, stages=stages
                ),
                events=self._events,
                nonfinite_guard=NonFiniteGuard(config.nonfinite, dist_context.logger),
                loss_group=dist_context.world_group(),
                loss_replication=self._mesh.tensor_parallel * self._mesh.context_parallel,
            )
        )

    def _build_plan(self, total_steps: int) -> RunPlan:
        config = self._config
        return RunPlan(
            total_steps=total_steps,
            batch=self._layout,
            log_every_steps=config.logging.every_steps,
            progress_bar=config.logging.progress_bar,
            checkpoint_every_steps=config.checkpoint.every_steps,
            resume=config.checkpoint.resume_options,
            first_step_seconds=config.timeouts.first_step_seconds,
            step_seconds=config.timeouts.step_seconds,
            checkpoint_trainable_only=isinstance(config.peft, LoRAConfig),
            read_figures=config.logging.read_figures,
        )

    def _build_program(self) -> PipelineProgram | None:
        """The pipeline program, or None without pipeline parallelism."""
        ranks, microbatches = self._mesh.pipeline_parallel, self._layout.microbatches_per_step
        if ranks == 1:
            return None
        match self._schedule:
            case PipelineProgram() as program:
                if program.num_ranks != ranks or program.num_microbatches != microbatches:
                    raise ValueError(
                        f"the given pipeline program runs {program.num_microbatches} microbatches on "
                        f"{program.num_ranks} ranks; this job has mesh.pipeline_parallel={ranks} and "
                        f"{microbatches} microbatches per step"
                    )
                return program
            case builder:
                return builder.build_program(num_ranks=ranks, num_microbatches=microbatches)

    def _build_stages(
        self, dist_context: DistributedContext, program: PipelineProgram | None
    ) -> list[BuiltStage[Any]]:
        infos = (
            program.stage_infos(dist_context.pipeline_rank)
            if program is not None
            else [PipelineStageInfo(current_stage=0, num_stages=1)]
        )
        factory = ModelStageFactory(
            provider=self._model_provider,
            dist_context=dist_context,
            config=self._config.initialization,
            seed=self._config.seed,
            peft=self._config.peft,
        )
        return [factory.build(info, keep_meta_copy=program is not None) for info in infos]

    def _check_memory(self, dist_context: DistributedContext) -> None:
        """Logs the memory estimate; refuses a job over the device (``d9d.loop.estimate``)."""
        check_memory_at_configure(
            model=self._model_provider,
            data=self._data_provider,
            optimizer=self._optimizer_provider,
            trainer=self._config,
            mesh=self._mesh,
            budget_bytes=device_budget_bytes(dist_context.device),
            logger=dist_context.logger,
            processes_per_host=dist_context.local_world_size,
        )

    def _build_model(
        self, dist_context: DistributedContext, program: PipelineProgram | None
    ) -> tuple[list[BuiltStage[Any]], StagesReadyResult]:
        """This rank's stages, once every rank's are built and ready (collective), announced."""
        stages = self._build_stages(dist_context, program)
        # Collective on every rank: e.g. a fresh tied head takes the first stage's embedding.
        ready = self._model_provider.stages_ready(
            StagesReadyContext(dist_context=dist_context, stages=[(s.stage, s.model) for s in stages])
        )
        self._events.publish(ModelReady(model_stages=tuple(s.model for s in stages)))
        return stages, ready

    def _build_data(self, dist_context: DistributedContext) -> BatchSource[Any]:
        layout = self._layout
        return self._data_provider.build(
            DataProviderContext(
                dist_context=dist_context,
                global_batch_size=layout.global_batch_size,
                local_batch_size=layout.local_batch_size,
                dp_rank=dist_context.data_parallel_rank,
                dp_size=layout.data_parallel_size,
            )
        )

    def _build_optimization(
        self, dist_context: DistributedContext, models: Sequence[nn.Module], total_steps: int
    ) -> tuple[torch.optim.Optimizer, LRScheduler]:
        optimizer = self._optimizer_provider.build(
            OptimizerProviderContext(dist_context=dist_context, model_stages=models)
        )
        lr_scheduler = self._lr_scheduler_provider.build(
            LRSchedulerProviderContext(
                dist_context=dist_context, optimizer=optimizer, total_steps=total_steps
            )
        )
        return optimizer, lr_scheduler

    def _build_gradients(
        self,
        dist_context: DistributedContext,
        program: PipelineProgram | None,
        models: Sequence[nn.Module],
        ready: StagesReadyResult,
    ) -> GradientManager:
        config = self._config
        return GradientManager(
            stages=models,
            data_parallel_size=self._layout.data_parallel_size,
            bucket_size_mb=config.gradient_bucket_size_mb,
            clipping=config.gradient_clipping,
            pp_group=dist_context.pipeline_group() if program is not None else None,
            norm_duplicates=ready.norm_duplicates,
        )

    def _build_step_runner(
        self,
        dist_context: DistributedContext,
        program: PipelineProgram | None,
        stages: Sequence[BuiltStage[Any]],
        task: TrainTask[Any, Any, Any, Any, Any],
        gradients: GradientManager,
    ) -> StepRunner:
        if program is None:
            return SequentialStepRunner(model=stages[0].model, task=task, gradients=gradients)
        adapters: dict[int, PipelineStageAdapter] = {}
        for s in stages:
            if s.meta_model is None:  # built with keep_meta_copy whenever there is a program
                raise RuntimeError(f"stage {s.stage.current_stage} was built without its meta copy")
            adapters[s.stage.current_stage] = PipelineStageAdapter(
                s.model, s.meta_model, is_first=s.stage.is_first
            )
        executor = PipelineExecutor(
            program, adapters, group=dist_context.pipeline_group(), device=dist_context.device
        )
        return PipelinedStepRunner(
            executor=executor,
            adapters=list(adapters.values()),
            stage_positions={s.stage.current_stage: i for i, s in enumerate(stages)},
            task=task,
            gradients=gradients,
        )

    def _build_checkpointer(
        self,
        dist_context: DistributedContext,
        models: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        lock: CheckpointLock | None,
    ) -> Checkpointer | None:
        config = self._config.checkpoint
        if config.directory is None:
            return None
        return Checkpointer(
            config=config,
            dist_context=dist_context,
            expected_bytes=estimate_checkpoint_bytes(models, optimizer),
            lock=lock,
        )

    def _build_exporter(
        self, dist_context: DistributedContext, stages: Sequence[BuiltStage[Any]]
    ) -> ModelExporter:
        source = self._config.initialization.source
        return ModelExporter(
            provider=self._model_provider,
            stages=stages,
            dist_context=dist_context,
            peft=self._config.peft,
            base_model=None if source is None else str(source),
        )

    def _build_tracker(self, dist_context: DistributedContext) -> Tracker:
        if self._tracker is not None:
            return self._tracker
        if not dist_context.is_main_process:
            return NoTracker()  # only the main process writes
        metadata = run_metadata(trainer=self._config, mesh=self._mesh)
        return build_trackers(self._config.logging.chosen_trackers, metadata=metadata)


def _task_of(
    provider: TaskProvider | TaskFactory, context: TaskProviderContext
) -> TrainTask[Any, Any, Any, Any, Any]:
    if isinstance(provider, TaskProvider):
        return provider.build(context)
    return provider(context)


def _context_mesh(dist_context: DistributedContext | None) -> MeshParameters:
    if dist_context is None:  # excluded by the caller's check; keeps the type narrow
        raise ValueError("TrainingConfigurator needs exactly one of mesh= and dist_context=")
    return dist_context.parameters
