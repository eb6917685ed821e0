"""The model provider contract: build, parallelize and export one pipeline stage of the model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from torch import nn

from d9d.loop._rank_stages import RankStagesContext
from d9d.loop.estimate._describe import DescribeMemoryContext, DescribeMemoryResult
from d9d.loop.observability._flops import EstimateFlopsContext, EstimateFlopsResult
from d9d.mesh import DistributedContext
from d9d.pipeline import PipelineStageInfo
from d9d.state_mappers import StateMapper

ModelT = TypeVar("ModelT", bound=nn.Module)


@dataclass(kw_only=True, frozen=True)
class InitializeModelStageContext:
    """Input of ``ModelProvider.initialize_model_stage``.

    Attributes:
        dist_context: The job's distributed context.
        stage: Which pipeline stage to build (stage 0 of 1 without pipeline parallelism).
    """

    dist_context: DistributedContext
    stage: PipelineStageInfo


@dataclass(kw_only=True, frozen=True)
class InitializeModelStageResult(Generic[ModelT]):
    """The stage's model (built on the meta device by the loop) and its load-time state mapper.

    Attributes:
        model: The stage module; its ``forward(inputs, shared)`` is called by the loop.
        state_mapper: Maps a source checkpoint's tensors to the model's state (for loading).
    """

    model: ModelT
    state_mapper: StateMapper | None = None


@dataclass(kw_only=True, frozen=True)
class ParallelizeModelStageContext(Generic[ModelT]):
    """Input of ``ModelProvider.parallelize_model_stage``."""

    dist_context: DistributedContext
    stage: PipelineStageInfo
    model: ModelT


@dataclass(kw_only=True, frozen=True)
class LoadModelStageContext(Generic[ModelT]):
    """Input of ``ModelProvider.load_model_stage``: the stage, parallelized and materialized.

    Attributes:
        dist_context: The job's distributed context.
        stage: Which pipeline stage ``model`` is.
        model: The stage on the device, its parameters uninitialized (``to_empty``).
    """

    dist_context: DistributedContext
    stage: PipelineStageInfo
    model: ModelT


@dataclass(kw_only=True, frozen=True)
class LoadModelStageResult:
    """Whether the provider gave the stage its values.

    Attributes:
        loaded: True when every parameter and buffer has its values; False lets the loop
            initialize the stage (``reset_parameters()`` or ``trainer.initialization.source``).
    """

    loaded: bool


@dataclass(kw_only=True, frozen=True)
class PrepareExportModelStageContext(Generic[ModelT]):
    """Input of ``ModelProvider.prepare_export_model_stage``."""

    dist_context: DistributedContext
    stage: PipelineStageInfo
    model: ModelT


@dataclass(kw_only=True, frozen=True)
class PrepareExportModelStageResult:
    """How one stage is exported.

    Attributes:
        state_mapper: Turns the stage's state into the exported checkpoint's tensors. Under pipeline
            parallelism every tensor must come from exactly one stage (a tied weight: the first).
        files: Extra files written beside the tensors, by name (e.g. ``config.json``, tokenizer
            files); any stage may give them.
    """

    state_mapper: StateMapper
    files: Mapping[str, bytes] = field(default_factory=dict[str, bytes])


@dataclass(kw_only=True, frozen=True)
class FinalizeGradientsContext(RankStagesContext[ModelT]):
    """Input of ``ModelProvider.finalize_gradients``: this rank's stages, gradients synchronized.

    Attributes:
        dist_context: The job's distributed context.
        stages: This rank's stages and their models, in increasing stage order.
    """


@dataclass(kw_only=True, frozen=True)
class OptimizerSteppedContext(RankStagesContext[ModelT]):
    """Input of ``ModelProvider.optimizer_stepped``: this rank's stages, just updated.

    Attributes:
        dist_context: The job's distributed context.
        stages: This rank's stages and their models, in increasing stage order.
        step: The optimizer step (0-based) that was applied.
    """

    step: int


@dataclass(kw_only=True, frozen=True)
class StagesReadyContext(RankStagesContext[ModelT]):
    """Input of ``ModelProvider.stages_ready``: this rank's stages, built and initialized or loaded.

    Attributes:
        dist_context: The job's distributed context.
        stages: This rank's stages and their models, in increasing stage order.
    """


@dataclass(kw_only=True, frozen=True)
class StagesReadyResult:
    """What the loop should know about parameters that span stages.

    Attributes:
        norm_duplicates: Parameters of this rank whose gradient duplicates another parameter's
            (after ``finalize_gradients``), e.g. the last stage's copy of a tied embedding: left out
            of the global gradient norm so that the weight counts once, still clipped alike.
    """

    norm_duplicates: Sequence[nn.Parameter] = ()


class ModelProvider(ABC, Generic[ModelT]):
    """Builds and distributes the model, one pipeline stage at a time.

    The loop calls ``initialize_model_stage`` under ``torch.device("meta")``, then
    ``parallelize_model_stage`` (which calls ``d9d.parallel.parallelize_*`` on submodules), then
    materializes the stage on the device and initializes or loads it.
    """

    @abstractmethod
    def initialize_model_stage(
        self, context: InitializeModelStageContext
    ) -> InitializeModelStageResult[ModelT]:
        """Builds the layers of ``context.stage`` (no parameter values are needed: meta device)."""

    @abstractmethod
    def parallelize_model_stage(self, context: ParallelizeModelStageContext[ModelT]) -> None:
        """Applies parallelism to ``context.model`` in place."""

    def load_model_stage(self, context: LoadModelStageContext[ModelT]) -> LoadModelStageResult:
        """Gives the materialized stage its values from the provider's own source, if it has one.

        For a provider configured with a checkpoint (say a Hugging Face model id), which may
        also need what a plain state mapper cannot express: a head the checkpoint lacks keeps
        its fresh initialization. Runs after the per-stage seed is set. Loads nothing by default.
        """
        del context
        return LoadModelStageResult(loaded=False)

    def estimate_flops(self, context: EstimateFlopsContext[ModelT]) -> EstimateFlopsResult:
        """States the model's training FLOPs per token, for the MFU metric; unknown by default.

        Called once, after the stages are built and parallelized.
        """
        del context
        return EstimateFlopsResult()

    def describe_memory(self, context: DescribeMemoryContext) -> DescribeMemoryResult:
        """States the model's shape for the memory estimate (``d9d estimate``, the configure-time
        check); unknown by default, and then nothing is estimated.

        Called before any process group exists or any weight is read: read the model's config,
        never its weights.
        """
        del context
        return DescribeMemoryResult()

    def stages_ready(self, context: StagesReadyContext[ModelT]) -> StagesReadyResult:
        """Runs once, on every rank, after all of the rank's stages are built and initialized.

        May run collectives (every rank calls it, at the same point): e.g. copy a freshly
        initialized tied embedding from the first stage to the last. Returns nothing to note by
        default.
        """
        del context
        return StagesReadyResult()

    def finalize_gradients(self, context: FinalizeGradientsContext[ModelT]) -> None:
        """Runs once per step after data-parallel gradient sync and before clipping.

        For gradients that span stages, e.g. an embedding tied to the LM head under pipeline
        parallelism (sum both copies' gradients over the first and last stage). Does nothing by
        default.
        """
        del context

    def optimizer_stepped(self, context: OptimizerSteppedContext[ModelT]) -> None:
        """Runs on every rank right after each applied optimizer step (not after a skipped one).

        For state derived from the new weights, e.g. the float8 scales of FSDP's float8
        all-gather (``d9d.parallel.precompute_float8_scales``, one all-reduce). Does nothing by
        default.
        """
        del context

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext[ModelT]
    ) -> PrepareExportModelStageResult:
        """Returns the export state mapper; required only for ``Trainer.export``."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement prepare_export_model_stage, "
            "so the model cannot be exported"
        )
