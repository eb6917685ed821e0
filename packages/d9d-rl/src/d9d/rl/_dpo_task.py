"""DPO (or IPO) as a d9d-loop task on a d9d-hf causal LM: preference pairs in, preference loss out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d9d.hf import DecoderInputs
from d9d.loop import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    CreateMetricsContext,
    CreateMetricsResult,
    TrainTask,
    UpdateMetricsContext,
)
from d9d.loop.metrics import Metric, WeightedMean
from d9d.rl._dpo_batch import DPOBatch
from d9d.rl._dpo_loss import DPOLossConfig, DPOLossResult, dpo_loss, sequence_log_probs
from d9d.rl._reference_model import ReferenceModel

METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
"""The task's metrics, named as TRL's ``DPOTrainer`` logs them; each is a mean over pairs."""


@dataclass(kw_only=True)
class DPOState:
    """What ``DPOTask.compute_loss`` reads per microbatch (rows interleaved as in ``DPOBatch``)."""

    targets: torch.Tensor
    ref_log_probs: torch.Tensor


class DPOTask(TrainTask[DPOBatch, DecoderInputs, None, torch.Tensor, DPOState]):
    """Trains a ``DecoderCausalLM`` (any family) on ``DPOBatch`` pairs with ``dpo_loss``.

    The model's training forward returns per-token cross-entropy, ``-log p`` of each target, so
    no logits are kept. Each microbatch's loss is the mean over its pairs and its weight their
    count: the step optimizes the mean over every pair of the global batch on any layout.
    Metrics (``METRIC_NAMES``) are means over pairs, summed over microbatches and data-parallel
    ranks by d9d-loop before dividing.

    The reference log-probs come with the batch (``DPODataProvider(reference=...)`` scores every
    pair before training) or, with ``reference``, from a colocated ``ReferenceModel`` laid out
    like the policy (attach it to the trainer before ``train()``), which scores each step's rows
    before the policy's forward.

    Args:
        config: The loss kind and its constants.
        reference: The colocated reference; None reads the scores from the batch.
    """

    def __init__(
        self, config: DPOLossConfig | None = None, *, reference: ReferenceModel | None = None
    ) -> None:
        self._config = config if config is not None else DPOLossConfig()
        self._reference = reference

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[DPOBatch]
    ) -> BuildForwardInputsResult[DecoderInputs, None, DPOState]:
        """The rows as they are (targets already shifted); refuses an odd number of rows."""
        batch = ctx.batch
        rows = batch.input_ids.shape[0]
        # pairs weigh their tokens unequally: no summed_losses
        inputs = DecoderInputs(input_ids=batch.input_ids, labels=batch.targets)
        ref = self._ref_log_probs(batch, inputs)
        if rows % 2 != 0 or batch.targets.shape != batch.input_ids.shape or ref.shape != (rows,):
            raise ValueError(
                f"a DPOBatch needs chosen/rejected row pairs: input_ids {tuple(batch.input_ids.shape)}, "
                f"targets {tuple(batch.targets.shape)}, ref_log_probs {tuple(ref.shape)}"
            )
        return BuildForwardInputsResult(
            input=inputs,
            shared=None,
            state=DPOState(targets=batch.targets, ref_log_probs=ref),
            num_tokens=int(batch.input_ids.numel()),
        )

    def _ref_log_probs(self, batch: DPOBatch, inputs: DecoderInputs) -> torch.Tensor:
        """Each row's summed reference log-prob: the batch's, or the colocated reference's."""
        if self._reference is None:
            if batch.ref_log_probs is None:
                raise ValueError(
                    "the DPOBatch has no ref_log_probs and DPOTask has no reference: build "
                    "DPODataProvider(reference=...) or pass DPOTask(reference=ReferenceModel(...))"
                )
            return batch.ref_log_probs
        if batch.ref_log_probs is not None:
            raise ValueError(
                "the DPOBatch carries ref_log_probs and DPOTask has a colocated reference too: "
                "build DPODataProvider(reference=None) or drop DPOTask(reference=...)"
            )
        return self._reference.log_probs(inputs).double().sum(dim=-1).float()

    def _result(self, losses: torch.Tensor, state: DPOState) -> DPOLossResult:
        rows = losses.shape[0]
        if rows % 2 != 0:
            raise ValueError(
                f"a microbatch of {rows} rows splits a chosen/rejected pair: "
                "trainer.microbatch_size counts pairs, and the rows of a step must divide into whole pairs"
            )
        mask = state.targets != -100
        kind = self._config.loss
        policy = sequence_log_probs(-losses.float(), mask, loss=kind)
        ref = state.ref_log_probs.float()
        if kind == "ipo":
            ref = ref / mask.sum(dim=-1).clamp(min=1).to(ref.dtype)
        return dpo_loss(
            chosen_log_probs=policy[0::2],
            rejected_log_probs=policy[1::2],
            ref_chosen_log_probs=ref[0::2],
            ref_rejected_log_probs=ref[1::2],
            config=self._config,
        )

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, DPOState]) -> ComputeLossResult:
        """The mean preference loss over this microbatch's pairs, weighted by their count."""
        result = self._result(ctx.pipeline_results, ctx.state)
        return ComputeLossResult(loss=result.loss, loss_weight=float(result.chosen_rewards.numel()))

    def create_metrics(self, ctx: CreateMetricsContext) -> CreateMetricsResult:
        """``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``."""
        del ctx
        metrics: dict[str, Metric] = {name: WeightedMean() for name in METRIC_NAMES}
        return CreateMetricsResult(metrics=metrics)

    def update_metrics(self, ctx: UpdateMetricsContext[torch.Tensor, DPOState]) -> None:
        """Adds this microbatch's pairs (each weighs 1)."""
        result = self._result(ctx.pipeline_results.detach(), ctx.state)
        values = (result.chosen_rewards, result.rejected_rewards, result.margins, result.accuracies)
        for name, value in zip(METRIC_NAMES, values, strict=True):
            ctx.metrics[name].update(value)
