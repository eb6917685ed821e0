"""A frozen reference policy: built and laid out like the policy, off the device between uses."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.distributed.fsdp import FSDPModule

from d9d.hf import DecoderInputs
from d9d.loop import ModelProvider, TensorOffloader, Trainer
from d9d.mesh import DistributedContext, map_tree
from d9d.rl._reference_build import build_reference_stage


class ReferenceConfig(BaseModel):
    """How the reference model is kept and run.

    Attributes:
        offload: Between uses the reference's parameters live in host memory (pinned on CUDA)
            and their device storage is freed, so the reference costs no device memory while
            the policy trains or the rollout engine generates; each ``log_probs`` call copies
            them in and out again (twice the reference's bytes over the host link). False keeps
            them on the device (faster, costs one copy of the weights for the whole run).
        microbatch_size: Rows per reference forward (None: every row of the call in one
            forward). Only the activation memory depends on it, never the values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    offload: bool = True
    microbatch_size: int | None = Field(default=None, ge=1)


def _row_slice(inputs: DecoderInputs, start: int, stop: int, device: torch.device) -> DecoderInputs:
    """Rows ``start:stop`` of every ``(batch, seq)`` tensor of ``inputs``, on ``device``."""
    rows = map_tree(inputs, lambda tensor, _path: tensor[start:stop].to(device))
    # no backward follows: the head must not compute its gradients in the forward
    return dataclasses.replace(rows, summed_losses=False)


class ReferenceModel:
    """The frozen reference policy of KL-regularized RL (GRPO's ``beta``, DPO's reference).

    Built by a d9d-loop ``ModelProvider`` (the policy's own, or one configured with another
    checkpoint) on the trainer's mesh exactly as the policy's stage is: the same
    ``initialize_model_stage`` / ``parallelize_model_stage`` calls, so its tensors carry the
    policy's names, shapes and placements (FSDP shards, TP splits) and its forward runs the same
    computation on the same rows. Its values: the provider's own checkpoint when its
    ``load_model_stage`` loads one, else a copy of the policy's weights as they are when
    ``attach`` runs (before ``train()``: the checkpoint or fresh initialization the policy
    starts from; a resumed run still takes them before the trainer restores its checkpoint).
    Every parameter is frozen (``requires_grad=False``) and the module is in eval mode.

    State: built after ``attach``; with ``config.offload`` its storages are in host memory except
    during a ``log_probs`` call (``is_offloaded``).

    Args:
        provider: Builds the reference's stage; the policy's provider for the same checkpoint.
        config: Offloading and the rows per forward.
    """

    def __init__(self, provider: ModelProvider[Any], config: ReferenceConfig | None = None) -> None:
        self._provider = provider
        self._config = config if config is not None else ReferenceConfig()
        self._model: nn.Module | None = None
        self._offloader: TensorOffloader | None = None
        self._device = torch.device("cpu")

    @property
    def config(self) -> ReferenceConfig:
        """How the reference is kept and run."""
        return self._config

    @property
    def module(self) -> nn.Module:
        """The reference's stage (raises before ``attach``/``build``)."""
        if self._model is None:
            raise RuntimeError("the reference model is not built yet: call attach(trainer) after configure()")
        return self._model

    @property
    def is_offloaded(self) -> bool:
        """Whether the reference's parameters are in host memory now."""
        return self._offloader is not None and self._offloader.is_offloaded

    def attach(self, trainer: Trainer) -> None:
        """Builds the reference beside ``trainer``'s policy (after ``configure()``, before ``train()``).

        Raises:
            ValueError: If the trainer has several pipeline stages on this rank, or has trained
                (the policy's weights are then no longer the ones it started from).
        """
        if len(trainer.model_stages) != 1:
            raise ValueError(
                f"the reference model needs one model stage per rank (no pipeline parallelism), "
                f"got {len(trainer.model_stages)}"
            )
        if trainer.step != 0:
            raise ValueError(
                f"attach the reference model before training: the trainer is at step {trainer.step}, "
                "so its weights are not the ones the policy started from"
            )
        self.build(dist_context=trainer.dist_context, policy=trainer.model_stages[0])

    def build(self, *, dist_context: DistributedContext, policy: nn.Module) -> None:
        """Builds the reference on ``dist_context``'s mesh, laid out and checked like ``policy``.

        ``attach`` calls this with the trainer's context and stage; call it directly to use the
        reference without a ``Trainer`` (every rank of the mesh calls it: FSDP and TP are
        collective).

        Args:
            dist_context: The mesh the policy is laid out on.
            policy: The policy's stage: the reference's names and shapes must be its, and its
                current weights are the reference's when the provider loads none.

        Raises:
            ValueError: If a tensor's name or shape differs from the policy's (naming it), before
                any value is loaded.
            RuntimeError: If the reference is built already.
        """
        if self._model is not None:
            raise RuntimeError("the reference model is built already")
        model = build_reference_stage(self._provider, dist_context=dist_context, policy=policy)
        model.requires_grad_(False)
        model.eval()
        self._model = model
        self._device = dist_context.device
        self._offloader = TensorOffloader(dist_context.device) if self._config.offload else None
        self._release()

    @torch.no_grad()
    def log_probs(self, inputs: DecoderInputs) -> torch.Tensor:
        """Per-token log-probabilities of ``inputs.labels`` under the reference.

        The reference runs the model's own training forward (the causal-LM head's per-token
        cross-entropy, whose negative is the label's log-probability) on ``inputs`` as given:
        pass the policy's inputs (same padding, packing, attention mask) to get values aligned
        with the policy's. Every rank of the mesh calls this with the same number of rows (FSDP
        gathers inside the forward). With ``config.offload`` the parameters come to the device
        for the call and leave after it.

        Args:
            inputs: ``DecoderInputs`` with ``labels`` (``-100`` where no log-prob is wanted).

        Returns:
            ``(batch, seq)`` float32 on the inputs' device (the forward runs on the mesh's):
            ``log p_ref(labels[b, t] | tokens <= t)`` where ``labels != -100``, 0 elsewhere.

        Raises:
            ValueError: If ``inputs.labels`` is missing or not the shape of ``input_ids``.
        """
        labels = inputs.labels
        if labels is None or labels.shape != inputs.input_ids.shape:
            raise ValueError(
                f"reference log-probs need DecoderInputs.labels of shape {tuple(inputs.input_ids.shape)}, "
                f"got {None if labels is None else tuple(labels.shape)}"
            )
        model = self.module
        rows = int(inputs.input_ids.shape[0])
        step = self._config.microbatch_size or max(rows, 1)
        self._wake()
        try:
            chunks = [_row_slice(inputs, s, s + step, self._device) for s in range(0, rows, step)]
            parts = [self._forward(model, chunk) for chunk in chunks]
        finally:
            self._release()
        out = torch.cat(parts).to(labels.device) if parts else torch.zeros(labels.shape, dtype=torch.float32)
        return out.masked_fill(labels == -100, 0.0)

    @staticmethod
    def _forward(model: nn.Module, inputs: DecoderInputs) -> torch.Tensor:
        output = model(inputs, None)
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"the reference's forward returned {type(output).__name__}; it needs one causal-LM "
                "head whose output is the per-token cross-entropy"
            )
        return -output.float()

    def _wake(self) -> None:
        if self._offloader is not None and self._offloader.is_offloaded:
            self._offloader.restore()

    def _release(self) -> None:
        """Frees what the forward left on the device: gathered FSDP parameters, then (offload) all."""
        model = self.module
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # FSDP keeps the root's gathered parameters after a forward (it expects a backward)
                module.reshard()
        if self._offloader is not None:
            self._offloader.offload([*model.parameters(), *model.buffers()])
