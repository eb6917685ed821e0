"""The several-head training task for d9d-loop: one loss per head, weighted and summed; metrics per head."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from d9d.hf._causal_lm_task import IGNORE_INDEX
from d9d.hf._decoder import DecoderInputs, MultiHeadOutput, causal_lm_targets, check_padding_at_row_ends
from d9d.hf._head_config import HeadConfig
from d9d.kernels.layers import check_pooling_mask
from d9d.loop import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    CreateMetricsContext,
    CreateMetricsResult,
    TaskProviderContext,
    TrainTask,
    UpdateMetricsContext,
)
from d9d.loop.metrics import Metric


def _empty_labels() -> dict[str, torch.Tensor]:
    return {}


@dataclass(kw_only=True)
class MultiHeadSample:
    """One row, one sequence.

    Attributes:
        input_ids: ``(seq,)`` token ids.
        labels: ``(seq,)`` Hugging Face style labels of the language-model head (``-100`` where
            no loss is wanted); None trains it on every token.
        class_labels: Per classification head name, the row's class (a 0-d integer tensor).
        attention_mask: ``(seq,)`` nonzero on real tokens; None derives it from ``pad_token_id``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    class_labels: dict[str, torch.Tensor] = field(default_factory=_empty_labels)
    attention_mask: torch.Tensor | None = None


@dataclass(kw_only=True)
class MultiHeadBatch:
    """Rows of equal length: ``input_ids``, ``labels``, ``attention_mask`` ``(batch, seq)``,
    each ``class_labels`` entry ``(batch,)`` (see ``MultiHeadSample``)."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    class_labels: dict[str, torch.Tensor] = field(default_factory=_empty_labels)
    attention_mask: torch.Tensor | None = None

    @staticmethod
    def collate(samples: list[MultiHeadSample]) -> MultiHeadBatch:
        """Stacks equal-length samples (a collator for ``AutoDataProvider``).

        Checks the ``attention_mask`` here, on the host (``check_padding_at_row_ends``, and with
        class labels ``check_pooling_mask``): the model's forward then reads nothing back from the
        device.

        Raises:
            ValueError: If some samples have labels or a mask and others not, the class labels'
                keys differ, a row has padding between real tokens, or (with class labels) a row
                has no real token to pool (the row is named).
        """

        def stack(values: list[torch.Tensor | None]) -> torch.Tensor | None:
            present = [v for v in values if v is not None]
            if not present:
                return None
            if len(present) != len(values):
                raise ValueError("some samples have labels or attention_mask and others do not")
            return torch.stack(present)

        names = samples[0].class_labels.keys()
        if any(sample.class_labels.keys() != names for sample in samples):
            raise ValueError("every sample must carry the same class_labels keys")
        attention_mask = stack([s.attention_mask for s in samples])
        if attention_mask is not None:
            check_padding_at_row_ends(attention_mask)
            if names:  # a pooled head needs a real token in every row; checked here, not on the device
                check_pooling_mask(attention_mask)
        return MultiHeadBatch(
            input_ids=torch.stack([s.input_ids for s in samples]),
            labels=stack([s.labels for s in samples]),
            class_labels={name: torch.stack([s.class_labels[name] for s in samples]) for name in names},
            attention_mask=attention_mask,
        )


@dataclass(kw_only=True)
class MultiHeadState:
    """What the losses need beside the model's outputs.

    Attributes:
        targets: The language-model head's per-position targets (None without that head).
        class_labels: Per classification head, the rows' classes ``(batch,)``.
    """

    targets: torch.Tensor | None
    class_labels: dict[str, torch.Tensor]


class MultiHeadTask(TrainTask[MultiHeadBatch, DecoderInputs, None, MultiHeadOutput, MultiHeadState]):
    """Several heads on one backbone: the loss is ``sum(loss_weight * head loss)`` over the heads.

    Per microbatch, the language-model head's loss is the mean over its target tokens, a
    classification head's the cross-entropy mean over its rows; every microbatch weighs 1, so
    the step optimizes the mean over microbatches (equal for any data-parallel or pipeline
    layout of the same microbatch size). Metrics per head: ``<name>/loss`` and the configured
    classification metrics (``<name>/accuracy``, ``<name>/f1``, ``<name>/auroc``), accumulated on
    the last stage of every rank and combined across ranks by d9d-loop.

    Rows are one sequence each (no packed documents); context parallelism is not supported.

    Args:
        heads: The ``model.heads`` list (the same the model provider was given).
    """

    def __init__(self, heads: Sequence[HeadConfig]) -> None:
        self._heads = tuple(heads)
        self._has_lm = any(head.needs_token_targets for head in heads)

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[MultiHeadBatch]
    ) -> BuildForwardInputsResult[DecoderInputs, None, MultiHeadState]:
        """Next-token targets (with a language-model head) and every head's class labels."""
        batch = ctx.batch
        targets = None
        if self._has_lm:
            labels = batch.input_ids if batch.labels is None else batch.labels
            targets = causal_lm_targets(labels, ignore_index=IGNORE_INDEX)
        for head in self._heads:
            head.check_labels(batch.class_labels)
        return BuildForwardInputsResult(
            # the language-model head's loss is a mean over its targets: one weight per target token
            input=DecoderInputs(
                input_ids=batch.input_ids,
                labels=targets,
                attention_mask=batch.attention_mask,
                summed_losses=True,
            ),
            shared=None,
            state=MultiHeadState(targets=targets, class_labels=dict(batch.class_labels)),
            num_tokens=int(batch.input_ids.numel()),
        )

    def compute_loss(self, ctx: ComputeLossContext[MultiHeadOutput, MultiHeadState]) -> ComputeLossResult:
        """The loss-weighted sum of every head's loss; the microbatch weighs 1."""
        state = ctx.state
        terms = [
            head.loss_weight * head.loss(ctx.pipeline_results[head.name], state.targets, state.class_labels)
            for head in self._heads
        ]
        return ComputeLossResult(loss=torch.stack(terms).sum(), loss_weight=None)

    def create_metrics(self, ctx: CreateMetricsContext) -> CreateMetricsResult:
        """``<name>/loss`` per head, and each classification head's configured metrics."""
        del ctx
        metrics: dict[str, Metric] = {}
        for head in self._heads:
            metrics.update(head.create_metrics())
        return CreateMetricsResult(metrics=metrics)

    def update_metrics(self, ctx: UpdateMetricsContext[MultiHeadOutput, MultiHeadState]) -> None:
        """Adds one microbatch to every head's metrics."""
        state = ctx.state
        for head in self._heads:
            head.update_metrics(
                ctx.metrics, ctx.pipeline_results[head.name], state.targets, state.class_labels
            )


def multi_head_task(heads: Sequence[HeadConfig]) -> Callable[[TaskProviderContext], MultiHeadTask]:
    """A ``TaskFactory`` of ``MultiHeadTask`` for ``heads`` (refuses context parallelism).

    Args:
        heads: The ``model.heads`` list.
    """

    def build(context: TaskProviderContext) -> MultiHeadTask:
        if context.dist_context.parameters.context_parallel > 1:
            raise ValueError("several heads (rows of one sequence) do not support context parallelism")
        return MultiHeadTask(heads)

    return build
