"""Trainer configuration: run length, batching, checkpointing, logging, timeouts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from d9d.loop.config._evaluation import EvaluationConfig
from d9d.loop.config._observability import GarbageCollectionConfig, ProfilingConfig
from d9d.loop.config._trackers import AimTrackerConfig, TensorBoardTrackerConfig, WandbTrackerConfig
from d9d.loop.peft import FullFineTuningConfig, PeftConfig
from d9d.pipeline import OneFOneBScheduleConfig, PipelineScheduleConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _non_empty(value: object) -> object:
    if isinstance(value, str) and not value.strip():
        # Path("") is the working directory: almost never what an empty value meant
        raise ValueError("an empty path is not allowed (use '.' for the working directory)")
    return value


NonEmptyPath = Annotated[Path, BeforeValidator(_non_empty)]
"""A filesystem path; an empty string is refused instead of meaning the working directory."""


class ResumeConfig(_Strict):
    """How a run resumes from its latest usable checkpoint.

    Attributes:
        optimizer_state: ``load`` restores the optimizer's state (a checkpoint of another
            optimizer is refused); ``reset`` starts the optimizer afresh, e.g. after switching it.
        from_step: Resume from the checkpoint of this step instead of the newest, e.g. when the
            newest ones hold weights that diverged already (finite but huge, NaN at the next
            step). It must exist (checked before the model is built); the newer checkpoints are
            set aside as ``step_N.superseded``. Remove the key once the run saved past it.
    """

    optimizer_state: Literal["load", "reset"] = "load"
    from_step: int | None = Field(default=None, ge=0)


class CheckpointConfig(_Strict):
    """Periodic distributed checkpoints (PyTorch DCP) and automatic resume.

    Attributes:
        directory: Where checkpoints live, one sub-directory per saved step; None disables them.
        every_steps: Save after every this many optimizer steps (and at the end of the run).
        keep_last: Keep only this many complete checkpoints (older ones are deleted).
        asynchronous: Write in the background (``dcp.async_save``); the checkpoint becomes visible
            at the next step boundary once every rank has finished writing.
        resume: Resume from the newest usable checkpoint in ``directory`` when one exists:
            ``true`` (the defaults of ``ResumeConfig``), ``false``, or a ``ResumeConfig``.
        verify: What resume checks against each checkpoint's manifest before loading it:
            ``sizes`` (every file present with its recorded size; costs a ``stat`` per file) or
            ``checksums`` (also every file's CRC-32; reads the whole checkpoint once).
    """

    directory: NonEmptyPath | None = None
    every_steps: int = Field(default=100, ge=1)
    keep_last: int = Field(default=2, ge=1)
    asynchronous: bool = False
    resume: bool | ResumeConfig = True
    verify: Literal["sizes", "checksums"] = "sizes"

    @property
    def resume_options(self) -> ResumeConfig | None:
        """The resume settings, or None when resume is off."""
        match self.resume:
            case True:
                return ResumeConfig()
            case False:
                return None
            case ResumeConfig():
                return self.resume


class NoTrackerConfig(_Strict):
    """Log nowhere but the progress bar."""

    name: Literal["none"] = "none"


class JsonlTrackerConfig(_Strict):
    """Append one JSON object per logged step to ``path`` (main rank only)."""

    name: Literal["jsonl"] = "jsonl"
    path: NonEmptyPath


TrackerConfig = Annotated[
    NoTrackerConfig | JsonlTrackerConfig | TensorBoardTrackerConfig | WandbTrackerConfig | AimTrackerConfig,
    Field(discriminator="name"),
]


class LoggingConfig(_Strict):
    """Progress bar and metrics tracking.

    Attributes:
        progress_bar: Show a progress bar on the main rank (quiet when not a terminal unless forced).
        every_steps: Report metrics every this many steps.
        tracker: Where metrics go besides the progress bar.
        trackers: More trackers, written to side by side with ``tracker``.
        throughput_window: Throughput is smoothed over this many steps.
        peak_flops_per_device: The peak FLOP/s MFU divides by (None: known GPUs' dense bf16
            peak; no MFU on other devices).
        read_figures: When the host reads a step's loss, gradient norm and token count, the
            step's one wait for the device. ``after_step`` (default): at the step's end, so its
            events come before the next step starts; the device idles while the host prepares
            the next step. ``during_next_step``: once the next step's forward and backward are
            queued, so the device has work while the host waits; the step's
            ``ForwardBackwardFinished``, ``OptimizerStepFinished`` and ``StepFinished`` events,
            its tracker line and its non-finite check then come during the next step. A step that
            saves a checkpoint, evaluates, logs training metrics or ends the run is still read at
            its end. Not with ``nonfinite.policy: skip``, which reads them before the optimizer step.
    """

    progress_bar: bool = True
    every_steps: int = Field(default=1, ge=1)
    tracker: TrackerConfig = NoTrackerConfig()
    trackers: list[TrackerConfig] = Field(default_factory=list[TrackerConfig])
    throughput_window: int = Field(default=50, ge=1)
    peak_flops_per_device: float | None = Field(default=None, gt=0)
    read_figures: Literal["after_step", "during_next_step"] = "after_step"

    @property
    def chosen_trackers(self) -> list[TrackerConfig]:
        """``tracker`` (unless ``none``) followed by ``trackers``."""
        chosen = [self.tracker, *self.trackers]
        return [t for t in chosen if not isinstance(t, NoTrackerConfig)]


class TimeoutConfig(_Strict):
    """Timeouts that end a hung job with an error naming the step and rank.

    Attributes:
        collective_seconds: Timeout of every collective operation.
        step_seconds: A step that takes longer ends the job (None: no step watchdog).
        first_step_seconds: Allowance for the first step (compilation, warm-up).
    """

    collective_seconds: float = Field(default=600.0, gt=0)
    step_seconds: float | None = Field(default=None, gt=0)
    first_step_seconds: float = Field(default=1800.0, gt=0)


class GradientClippingConfig(_Strict):
    """Clip the global gradient norm (over all ranks and stages) to ``max_norm``; None = only measure."""

    max_norm: float | None = Field(default=1.0, gt=0)
    norm_type: float = Field(default=2.0, gt=0)


class InitializationConfig(_Strict):
    """How parameters get their first values when no source checkpoint is given.

    Attributes:
        layout_invariant: Run ``reset_parameters()`` on an unsharded CPU copy of the model and
            scatter the values into the parallelized parameters, so every mesh layout, pipeline
            parallelism included, starts from bit-identical weights (costs the stage's full size
            in host memory; with pipeline parallelism the whole model's, once per rank, and stage
            tensors must carry the whole model's names). When False, ``reset_parameters()`` runs
            directly on the sharded parameters on the device.
        source: A safetensors checkpoint (file or directory) loaded through the provider's state
            mapper instead of ``reset_parameters()``.
    """

    layout_invariant: bool = True
    source: NonEmptyPath | None = None


class SkipNonFinite(_Strict):
    """Skip the optimizer step of a non-finite loss or gradient norm (the batch is lost).

    The gradient norm is then read before the optimizer step instead of after it (still one
    host read per step). ``max_consecutive`` skipped steps in a row stop the run.
    """

    policy: Literal["skip"] = "skip"
    max_consecutive: int = Field(default=5, ge=1)


class StopOnNonFinite(_Strict):
    """End the run with ``NonFiniteError`` naming the step (the checkpoints stay as they are)."""

    policy: Literal["stop"] = "stop"


class RollbackOnNonFinite(_Strict):
    """Reload the newest checkpoint and go on; ``max_rollbacks`` rollbacks in one run stop it.

    The same data then reaches the same state again, so a deterministic divergence (a learning
    rate too high) stops after ``max_rollbacks``; a transient one (a flipped bit in memory) passes.
    """

    policy: Literal["rollback"] = "rollback"
    max_rollbacks: int = Field(default=3, ge=1)


NonFiniteConfig = Annotated[
    SkipNonFinite | StopOnNonFinite | RollbackOnNonFinite, Field(discriminator="policy")
]


class TrainerConfig(_Strict):
    """What a training run does.

    Attributes:
        max_steps: Run length in optimizer steps (exactly one of ``max_steps`` and ``epochs``).
        epochs: Run length in passes over the dataset.
        global_batch_size: Samples per optimizer step over all data-parallel ranks.
        microbatch_size: Samples per forward/backward on one rank; gradient accumulation steps are
            ``global_batch_size / (data_parallel * microbatch_size)``.
        seed: Seed of model initialization and every random generator.
        nonfinite: What a non-finite loss or gradient norm does (``stop`` by default).
        pipeline: The pipeline schedule (used when ``mesh.pipeline_parallel > 1``); the schedule's
            microbatches are this rank's ``global_batch_size / (data_parallel * microbatch_size)``.
        profiling: A ``torch.profiler`` window (None: off).
        garbage_collection: Collect at fixed steps with automatic GC off (the default: a young
            collection every 50 steps); None: Python's automatic collection.
        evaluation: Evaluate on held-out data during training (None: never).
        peft: ``{kind: full}`` (default) or ``{kind: lora, target, r, alpha, ...}``.
    """

    max_steps: int | None = Field(default=None, ge=1)
    epochs: int | None = Field(default=None, ge=1)
    global_batch_size: int = Field(ge=1)
    microbatch_size: int = Field(ge=1)
    seed: int = 0
    gradient_clipping: GradientClippingConfig = GradientClippingConfig()
    gradient_bucket_size_mb: float = Field(default=25.0, gt=0)
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    initialization: InitializationConfig = InitializationConfig()
    nonfinite: NonFiniteConfig = StopOnNonFinite()
    device: Literal["auto", "cpu", "cuda"] = "auto"
    pipeline: PipelineScheduleConfig = Field(default_factory=OneFOneBScheduleConfig)
    profiling: ProfilingConfig | None = None
    garbage_collection: GarbageCollectionConfig | None = GarbageCollectionConfig()
    evaluation: EvaluationConfig | None = None
    peft: PeftConfig = FullFineTuningConfig()

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("trainer needs exactly one of 'max_steps' and 'epochs'")
        if self.global_batch_size % self.microbatch_size != 0:
            raise ValueError(
                f"trainer.global_batch_size={self.global_batch_size} is not divisible by "
                f"trainer.microbatch_size={self.microbatch_size}"
            )
        if self.logging.read_figures == "during_next_step" and isinstance(self.nonfinite, SkipNonFinite):
            raise ValueError(
                "trainer.logging.read_figures=during_next_step cannot be combined with "
                "trainer.nonfinite.policy=skip, which reads the gradient norm before each optimizer step"
            )
        return self
