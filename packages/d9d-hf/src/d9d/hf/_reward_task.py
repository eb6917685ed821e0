"""The reward-model training task for d9d-loop: preference pairs in, Bradley-Terry loss out."""

from __future__ import annotations

from collections.abc import Callable

import torch

from d9d.hf._decoder import DecoderInputs, DecoderSpec
from d9d.hf._head import HeadName
from d9d.hf._provider import HFModelProvider
from d9d.hf._reward_data import RewardBatch
from d9d.hf._reward_loss import bradley_terry_loss
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
from d9d.loop.metrics import Metric, WeightedMean

REWARD_METRICS = ("accuracy", "margin", "chosen_reward", "rejected_reward")
"""The task's metrics: the fraction of pairs with ``r_chosen > r_rejected``, the mean
``r_chosen - r_rejected``, and the mean reward of each side."""


def pair_rewards(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` rewards ``(pairs,)`` of a reward model's ``(2 * pairs, 1)`` scores
    over ``RewardBatch`` rows (chosen and rejected interleaved).

    Raises:
        ValueError: If ``scores`` is not ``(even rows, 1)``.
    """
    if scores.ndim != 2 or scores.shape[1] != 1 or scores.shape[0] % 2:
        raise ValueError(
            f"a reward model's scores are (2 * pairs, 1) (head sequence_classification with "
            f"num_labels 1), got {tuple(scores.shape)}"
        )
    rewards = scores[:, 0].float()
    return rewards[0::2], rewards[1::2]


class RewardTask(TrainTask[RewardBatch, DecoderInputs, None, torch.Tensor, None]):
    """A reward model on preference pairs: the Bradley-Terry loss of TRL's ``RewardTrainer``.

    The loss of a microbatch is ``bradley_terry_loss`` over its pairs, weighted by its pair count,
    so a step optimizes the mean over all pairs of all ranks whatever the layout. Metrics
    (``REWARD_METRICS``) are sums over the pairs of every microbatch and rank, divided once:
    the accuracy is the fraction of all pairs, not a mean of per-rank fractions.

    Args:
        center_rewards_coefficient: TRL's centering term's factor (None: off).
    """

    def __init__(self, *, center_rewards_coefficient: float | None = None) -> None:
        self._center = center_rewards_coefficient

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[RewardBatch]
    ) -> BuildForwardInputsResult[DecoderInputs, None, None]:
        """The interleaved rows with their mask (the score is read at each row's last real token)."""
        batch = ctx.batch
        return BuildForwardInputsResult(
            input=DecoderInputs(input_ids=batch.input_ids, attention_mask=batch.attention_mask),
            shared=None,
            state=None,
            num_tokens=int(batch.input_ids.numel()),
        )

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, None]) -> ComputeLossResult:
        """The microbatch's mean pair loss, weighted by its pairs."""
        chosen, rejected = pair_rewards(ctx.pipeline_results)
        loss = bradley_terry_loss(chosen, rejected, center_rewards_coefficient=self._center)
        return ComputeLossResult(loss=loss, loss_weight=float(chosen.numel()))

    def create_metrics(self, ctx: CreateMetricsContext) -> CreateMetricsResult:
        """``accuracy``, ``margin``, ``chosen_reward``, ``rejected_reward`` (means over pairs)."""
        del ctx
        metrics: dict[str, Metric] = {name: WeightedMean() for name in REWARD_METRICS}
        return CreateMetricsResult(metrics=metrics)

    def update_metrics(self, ctx: UpdateMetricsContext[torch.Tensor, None]) -> None:
        """Adds the microbatch's pairs (each weighs 1)."""
        chosen, rejected = pair_rewards(ctx.pipeline_results.detach())
        ctx.metrics["accuracy"].update((chosen > rejected).float())
        ctx.metrics["margin"].update(chosen - rejected)
        ctx.metrics["chosen_reward"].update(chosen)
        ctx.metrics["rejected_reward"].update(rejected)


def check_reward_model(head: HeadName, spec: DecoderSpec, *, pad_token_id: int) -> None:
    """Refuses a model that is not a scalar reward model reading its score where the data says.

    Args:
        head: The model's ``model.head``.
        spec: Its config's numbers.
        pad_token_id: The padding id the pairs were built with.

    Raises:
        ValueError: Unless the head is ``sequence_classification`` with one label and the config's
            ``pad_token_id`` is ``pad_token_id`` (the export's config.json tells transformers where
            to read each row's score).
    """
    if head != "sequence_classification":
        raise ValueError(
            f"a reward model needs model.head: sequence_classification with model.num_labels: 1 "
            f"(not several heads), got head {head!r}"
        )
    if spec.num_labels != 1:
        raise ValueError(
            f"a reward model has one score: set model.num_labels: 1 (the config has {spec.num_labels})"
        )
    if spec.pad_token_id != pad_token_id:
        raise ValueError(
            f"the model's pad_token_id is {spec.pad_token_id}, the pairs are padded with {pad_token_id}: "
            "set model.pad_token_id (transformers reads each row's score at its last token that is "
            "not pad_token_id, so the export's config.json needs it)"
        )


def reward_task(
    provider: HFModelProvider, *, pad_token_id: int, center_rewards_coefficient: float | None = None
) -> Callable[[TaskProviderContext], RewardTask]:
    """A ``TaskFactory`` of ``RewardTask`` that checks the model first (``check_reward_model``).

    Args:
        provider: The model provider of the job.
        pad_token_id: The padding id of the ``RewardPairs`` and their collator.
        center_rewards_coefficient: TRL's centering term's factor (None: off).

    Raises:
        ValueError: When the task is built (before training), if the model is no reward model
            (``check_reward_model``) or the layout has context parallelism.
    """

    def build(context: TaskProviderContext) -> RewardTask:
        if context.dist_context.parameters.context_parallel > 1:
            raise ValueError("a reward model (rows of one sequence) does not support context parallelism")
        spec = provider.model_config(context.dist_context).decoder_spec()
        check_reward_model(provider.head, spec, pad_token_id=pad_token_id)
        return RewardTask(center_rewards_coefficient=center_rewards_coefficient)

    return build
