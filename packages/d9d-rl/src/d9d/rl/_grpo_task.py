"""GRPO as a d9d-loop task on a d9d-hf causal LM: rollouts in, clipped policy-gradient loss out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from d9d.hf import DecoderInputs
from d9d.loop import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    TrainTask,
)
from d9d.rl._losses import GRPOLossConfig, grpo_loss
from d9d.rl._reference_model import ReferenceModel
from d9d.rl._rollout_engine import Completion


@dataclass(kw_only=True)
class RolloutBatch:
    """Scored completions laid out for training; every tensor has the rows on dim 0.

    Attributes:
        input_ids: ``(rows, seq)`` prompt then completion, right-padded.
        targets: ``(rows, seq)`` the token position ``t`` should predict where it is a completion
            token, ``-100`` elsewhere (prompt, padding).
        old_log_probs: ``(rows, seq)`` the sampler's log-probability of each target (0 elsewhere).
        advantages: ``(rows,)`` one advantage per completion.
        ref_log_probs: ``(rows, seq)`` the reference model's log-probability of each target (0
            elsewhere), or None without a reference (``ColocatedRollouts(reference=...)`` fills it).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    ref_log_probs: torch.Tensor | None = None

    def decoder_inputs(self) -> DecoderInputs:
        """The model's input for these rows: the same for the policy and the reference."""
        return DecoderInputs(input_ids=self.input_ids, labels=self.targets)

    @staticmethod
    def from_completions(
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Completion],
        advantages: torch.Tensor,
        *,
        pad_token_id: int = 0,
    ) -> RolloutBatch:
        """Lays out each completion after its prompt (``completion.prompt_index``)."""
        lengths = [len(prompts[c.prompt_index]) + len(c.token_ids) for c in completions]
        width = max(lengths, default=1)
        rows = len(completions)
        input_ids = torch.full((rows, width), pad_token_id, dtype=torch.int64)
        targets = torch.full((rows, width), -100, dtype=torch.int64)
        old = torch.zeros(rows, width, dtype=torch.float32)
        for row, completion in enumerate(completions):
            prompt = list(prompts[completion.prompt_index])
            tokens = list(completion.token_ids)
            input_ids[row, : len(prompt) + len(tokens)] = torch.tensor(prompt + tokens, dtype=torch.int64)
            if tokens:
                # position t predicts token t + 1: the last prompt position predicts the first token
                span = slice(len(prompt) - 1, len(prompt) - 1 + len(tokens))
                targets[row, span] = torch.tensor(tokens, dtype=torch.int64)
                old[row, span] = completion.log_probs
        return RolloutBatch(
            input_ids=input_ids, targets=targets, old_log_probs=old, advantages=advantages.float()
        )


@dataclass(kw_only=True)
class GRPOState:
    """What ``GRPOTask.compute_loss`` reads per microbatch."""

    targets: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    ref_log_probs: torch.Tensor | None = None


class GRPOTask(TrainTask[RolloutBatch, DecoderInputs, None, torch.Tensor, GRPOState]):
    """Trains a ``DecoderCausalLM`` (any family) on a ``RolloutBatch`` with ``grpo_loss``.

    The model's training forward returns per-token cross-entropy, which is minus the
    log-probability of each target: the policy's log-probs without any logits in memory. The
    microbatch's loss weight is its token (or sequence) count, so the step optimizes the mean over
    the whole batch on every layout.

    With a reference model the k3 estimate of KL(policy || reference), weighted by
    ``config.kl_coefficient``, joins the loss (TRL's ``beta``) and the batch's mean KL is logged as
    the ``kl`` metric. The reference's log-probs travel in the batch
    (``RolloutBatch.ref_log_probs``): pass the same ``ReferenceModel`` to ``ColocatedRollouts``,
    which computes them after each rollout while the trainer sleeps.

    Args:
        config: The GRPO constants.
        reference: The reference model the batches' ``ref_log_probs`` come from; required when
            ``config.kl_coefficient > 0``.

    Raises:
        ValueError: If ``config.kl_coefficient > 0`` and no reference is given (before training).
    """

    def __init__(
        self, config: GRPOLossConfig | None = None, *, reference: ReferenceModel | None = None
    ) -> None:
        self._config = config if config is not None else GRPOLossConfig()
        self._with_reference = reference is not None
        if self._config.kl_coefficient > 0 and reference is None:
            raise ValueError(
                f"GRPOLossConfig.kl_coefficient={self._config.kl_coefficient} needs a reference model, and "
                "none is configured: pass GRPOTask(reference=ReferenceModel(...)) and the same to "
                "ColocatedRollouts(reference=...), or set kl_coefficient to 0"
            )

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[RolloutBatch]
    ) -> BuildForwardInputsResult[DecoderInputs, None, GRPOState]:
        batch = ctx.batch
        return BuildForwardInputsResult(
            input=batch.decoder_inputs(),
            shared=None,
            state=GRPOState(
                targets=batch.targets,
                old_log_probs=batch.old_log_probs,
                advantages=batch.advantages,
                ref_log_probs=self._ref_log_probs(batch),
            ),
            num_tokens=int(batch.input_ids.numel()),
        )

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, GRPOState]) -> ComputeLossResult:
        state = ctx.state
        mask = state.targets != -100
        result = grpo_loss(
            log_probs=-ctx.pipeline_results.float(),
            old_log_probs=state.old_log_probs,
            advantages=state.advantages,
            mask=mask,
            config=self._config,
            ref_log_probs=state.ref_log_probs,
        )
        metrics = {"clip_fraction": result.clip_fraction}
        if state.ref_log_probs is not None:
            metrics["kl"] = result.kl
        return ComputeLossResult(loss=result.loss, loss_weight=result.weight, metrics=metrics)

    def _ref_log_probs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """The batch's reference log-probs; refuses a batch without them when a reference is set."""
        if self._with_reference and batch.ref_log_probs is None:
            raise ValueError(
                "GRPOTask has a reference model but the batch has no ref_log_probs: give the batch "
                "source the same reference (ColocatedRollouts(reference=...))"
            )
        return batch.ref_log_probs if self._with_reference else None
