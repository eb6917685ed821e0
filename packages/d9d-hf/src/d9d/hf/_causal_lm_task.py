"""The causal-LM training task for d9d-loop: token batches in, token-weighted next-token loss out."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from d9d.hf._decoder import DecoderInputs, causal_lm_targets, resolve_positions
from d9d.loop import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    TaskProviderContext,
    TrainTask,
)
from d9d.mesh import BATCH_DOMAIN
from d9d.parallel import context_parallel_shard

IGNORE_INDEX = -100


@dataclass(kw_only=True)
class TokenSample:
    """One row: ``(seq,)`` tensors.

    Attributes:
        input_ids: Token ids.
        labels: Hugging Face style labels (``labels[t]`` is token ``t``, ``-100`` where no loss
            is wanted, e.g. the prompt); None trains on every token.
        document_ids: Ids of the documents packed into the row; None for one document.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None


@dataclass(kw_only=True)
class TokenBatch:
    """Rows of equal length, each field ``(batch, seq)`` (see ``TokenSample``)."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    @staticmethod
    def collate(samples: list[TokenSample]) -> TokenBatch:
        """Stacks equal-length samples (a collator for ``AutoDataProvider``)."""

        def stack(values: list[torch.Tensor | None]) -> torch.Tensor | None:
            present = [v for v in values if v is not None]
            if not present:
                return None
            if len(present) != len(values):
                raise ValueError("some samples have labels or document_ids and others do not")
            return torch.stack(present)

        return TokenBatch(
            input_ids=torch.stack([s.input_ids for s in samples]),
            labels=stack([s.labels for s in samples]),
            document_ids=stack([s.document_ids for s in samples]),
        )


@dataclass(kw_only=True)
class CausalLMState:
    """What the loss needs beside the model's per-token losses: the targets of this rank's tokens."""

    targets: torch.Tensor


class CausalLMTask(TrainTask[TokenBatch, DecoderInputs, None, torch.Tensor, CausalLMState]):
    """Next-token prediction, weighted by target tokens.

    Each microbatch's loss is the mean over its target tokens and its weight their count, so a
    step optimizes the mean over every target token of the global batch, however the tokens
    are split over microbatches, data-parallel and context-parallel ranks. With context
    parallelism every per-token tensor is cut into this rank's load-balanced part after the
    targets and positions are computed on the whole row.

    Args:
        cp_mesh: The 1-D context-parallel mesh, or None without context parallelism.
    """

    def __init__(self, *, cp_mesh: DeviceMesh | None = None) -> None:
        self._cp_mesh = cp_mesh

    def _shard(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._cp_mesh is None else context_parallel_shard(tensor, mesh=self._cp_mesh)

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[TokenBatch]
    ) -> BuildForwardInputsResult[DecoderInputs, None, CausalLMState]:
        """Targets shifted within each document, positions restarting per document, then sharded."""
        batch = ctx.batch
        labels = batch.input_ids if batch.labels is None else batch.labels
        targets = causal_lm_targets(labels, document_ids=batch.document_ids, ignore_index=IGNORE_INDEX)
        shard = self._shard
        local_targets = shard(targets)
        document_ids = batch.document_ids
        if self._cp_mesh is None and document_ids is None:
            # One document per row: the model numbers the positions itself.
            inputs = DecoderInputs(input_ids=batch.input_ids, labels=local_targets, summed_losses=True)
        elif document_ids is None:
            # A cut row's positions jump between the rank's two chunks: pass them, and say the row
            # is one document (no document mask: context parallelism's unmasked flash path).
            _, position_ids = resolve_positions(batch.input_ids, None, None)
            inputs = DecoderInputs(
                input_ids=shard(batch.input_ids),
                labels=local_targets,
                position_ids=shard(position_ids),
                one_document_per_row=True,
                summed_losses=True,
            )
        else:
            document_ids, position_ids = resolve_positions(batch.input_ids, document_ids, None)
            inputs = DecoderInputs(
                input_ids=shard(batch.input_ids),
                labels=local_targets,
                document_ids=None if document_ids is None else shard(document_ids),
                position_ids=shard(position_ids),
                summed_losses=True,
            )
        return BuildForwardInputsResult(
            input=inputs,
            shared=None,
            state=CausalLMState(targets=local_targets),
            num_tokens=int(batch.input_ids.numel()),  # every tp/cp rank reports the whole rows
        )

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, CausalLMState]) -> ComputeLossResult:
        """The mean loss over this microbatch's target tokens, weighted by their count.

        One weight for every target token: the inputs say ``summed_losses``, so the head computes its
        gradients in the forward.
        """
        # The count stays on the device (no host sync per microbatch); the loop reads it back once.
        count = (ctx.state.targets != IGNORE_INDEX).sum()
        loss = ctx.pipeline_results.sum() / count.clamp(min=1)
        return ComputeLossResult(loss=loss, loss_weight=count)


def causal_lm_task(context: TaskProviderContext) -> CausalLMTask:
    """A ``CausalLMTask`` for the job's mesh (a ``TaskFactory`` for ``TrainingConfigurator``)."""
    dist_context = context.dist_context
    if dist_context.parameters.context_parallel == 1:
        return CausalLMTask()
    return CausalLMTask(cp_mesh=dist_context.mesh_for(BATCH_DOMAIN)["cp"])
