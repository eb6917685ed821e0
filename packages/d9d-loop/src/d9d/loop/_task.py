"""The training task contract: turn a batch into model inputs, and model outputs into a loss."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

import torch

from d9d.loop.metrics import Metric
from d9d.mesh import DistributedContext

BatchT = TypeVar("BatchT")
InputT = TypeVar("InputT")
SharedT = TypeVar("SharedT")
OutputT = TypeVar("OutputT")
StateT = TypeVar("StateT")


@dataclass(kw_only=True, frozen=True)
class BuildForwardInputsContext(Generic[BatchT]):
    """Input of ``TrainTask.build_forward_inputs``.

    Attributes:
        batch: This rank's share of the global batch for the step (all its microbatches).
        step: The optimizer step about to run (0-based).
    """

    batch: BatchT
    step: int


@dataclass(kw_only=True, frozen=True)
class BuildForwardInputsResult(Generic[InputT, SharedT, StateT]):
    """What the model and the loss need.

    ``input`` and ``state`` are split into microbatches along tensor dim 0 by the loop; ``shared``
    reaches every microbatch (and every pipeline stage) unchanged.

    Attributes:
        input: Passed as ``model(input, shared)`` (per microbatch).
        shared: Passed to every forward unchanged.
        state: Passed to ``compute_loss`` (per microbatch), e.g. the labels.
        num_tokens: Tokens in this rank's batch, for tokens/s reporting (optional).
    """

    input: InputT
    shared: SharedT
    state: StateT
    num_tokens: int | None = None


@dataclass(kw_only=True, frozen=True)
class ComputeLossContext(Generic[OutputT, StateT]):
    """Input of ``TrainTask.compute_loss``: one microbatch's model output and state.

    Attributes:
        pipeline_results: The (last stage of the) model's output for this microbatch.
        state: This microbatch's share of ``BuildForwardInputsResult.state``.
        microbatch_index: Index of the microbatch within this rank's step.
        step: The optimizer step (0-based).
    """

    pipeline_results: OutputT
    state: StateT
    microbatch_index: int
    step: int


@dataclass(kw_only=True, frozen=True)
class ComputeLossResult:
    """A microbatch's loss and its weight.

    The step's objective is ``sum(loss_weight * loss) / sum(loss_weight)`` over all microbatches
    of all data-parallel ranks. With ``loss_weight=None`` every microbatch weighs 1 (so ``loss`` is
    a mean over the microbatch); for token-level losses, return the mean over the microbatch's
    tokens and their count as the weight.

    Attributes:
        loss: A scalar tensor.
        loss_weight: A scalar (tensor or number) or None.
        metrics: Extra scalars to report (averaged over microbatches and ranks).
    """

    loss: torch.Tensor
    loss_weight: torch.Tensor | float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict[str, float])


@dataclass(kw_only=True, frozen=True)
class CreateMetricsContext:
    """Input of ``TrainTask.create_metrics``.

    Attributes:
        purpose: ``train`` (reported at every logged step, over the steps since the last one) or
            ``evaluation`` (over one pass of the held-out data); each purpose gets its own objects.
    """

    purpose: Literal["train", "evaluation"]


@dataclass(kw_only=True, frozen=True)
class CreateMetricsResult:
    """The task's metrics by name (``auroc`` is reported as ``auroc``, or ``eval/auroc``)."""

    metrics: Mapping[str, Metric] = field(default_factory=dict[str, Metric])


@dataclass(kw_only=True, frozen=True)
class UpdateMetricsContext(Generic[OutputT, StateT]):
    """Input of ``TrainTask.update_metrics``: one microbatch's outputs (no autograd) and state.

    Attributes:
        pipeline_results: The (last stage of the) model's output for this microbatch.
        state: This microbatch's share of ``BuildForwardInputsResult.state``.
        metrics: The metrics ``create_metrics`` returned for this purpose.
        purpose: ``train`` or ``evaluation``.
    """

    pipeline_results: OutputT
    state: StateT
    metrics: Mapping[str, Metric]
    purpose: Literal["train", "evaluation"]


@dataclass(kw_only=True, frozen=True)
class TaskProviderContext:
    """Input of the task provider."""

    dist_context: DistributedContext


class TrainTask(ABC, Generic[BatchT, InputT, SharedT, OutputT, StateT]):
    """What is trained: inputs from a batch, and the loss from model outputs.

    Type parameters: ``Batch`` (what the collator returns), ``Input`` (the model's first forward
    argument), ``Shared`` (its second), ``Output`` (what the model returns), ``State`` (what
    ``compute_loss`` needs beside the output). ``state_dict``/``load_state_dict`` let a task keep
    state across checkpoints.
    """

    @abstractmethod
    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[BatchT]
    ) -> BuildForwardInputsResult[InputT, SharedT, StateT]:
        """Turns this rank's batch for the step into model input, shared data and loss state."""

    @abstractmethod
    def compute_loss(self, ctx: ComputeLossContext[OutputT, StateT]) -> ComputeLossResult:
        """Computes one microbatch's loss (on the last pipeline stage)."""

    def create_metrics(self, ctx: CreateMetricsContext) -> CreateMetricsResult:
        """The metrics to report (none by default); called once per purpose."""
        del ctx
        return CreateMetricsResult()

    def update_metrics(self, ctx: UpdateMetricsContext[OutputT, StateT]) -> None:
        """Adds one microbatch to ``ctx.metrics`` (on the last pipeline stage, without autograd)."""
        del ctx

    def state_dict(self) -> dict[str, Any]:
        """State saved in checkpoints (none by default).

        Tensors and plain Python values only (dict, list, tuple, set, str, int, float, bool,
        None): checkpoints load it with ``torch.load(weights_only=True)``; anything else is
        refused when a checkpoint is saved.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``state_dict`` returned."""
        del state


@runtime_checkable
class TaskProvider(Protocol):
    """Builds the task once the distributed context exists (the shape every provider shares)."""

    def build(self, context: TaskProviderContext) -> TrainTask[Any, Any, Any, Any, Any]:
        """Returns the task."""
        ...


TaskFactory = Callable[[TaskProviderContext], TrainTask[Any, Any, Any, Any, Any]]
"""A plain function works too: ``task_provider=lambda ctx: MyTask()``."""
