"""A decoder of any family with the causal language-modelling head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from d9d.hf._decoder._auxiliary_loss import attach_to_target_losses
from d9d.hf._decoder._family import DecoderFamily
from d9d.hf._decoder._inputs import DecoderInputs, StageHandoff, handoff_labels
from d9d.hf._decoder._model_base import DecoderModelBase
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, LanguageModelHead
from d9d.pipeline import PipelineStageInfo


class DecoderCausalLM(DecoderModelBase):
    """A decoder for next-token prediction; state names match transformers' ``*ForCausalLM``.

    Training (``forward``) returns per-token losses through the fused linear cross-entropy, so the
    ``(tokens, vocab)`` logits never exist; ``logits`` is for inference. The step's loss is
    ``losses.sum() / (labels != -100).sum()``, as transformers computes it. On MoE layers whose
    config.json sets ``output_router_logits`` (or ``model.load_balancing_loss: true``), the
    load-balancing loss (``router_aux_loss_coef`` times one Switch loss pooled over every sparse
    layer, as transformers' ``load_balancing_loss_func``) is added to the backward pass in
    training mode, as if added to every target token's loss: the gradient of
    that mean is the gradient of ``loss + aux``, the microbatch's weight applies to both.

    Tied embeddings (``tie_word_embeddings``): when one module holds both ends, ``lm_head.weight``
    *is* ``model.embed_tokens.weight``. Under pipeline parallelism the last stage holds its own
    copy, loaded from the same checkpoint tensor; keep the two equal by summing their gradients
    between the first and last stage before every optimizer step (``sum_tied_gradients``), and,
    when initializing from scratch, by copying the first stage's weight to the last
    (``broadcast_tied_weight``).

    Args:
        config: The model's config.json (a family's config model).
        stage: The pipeline stage to build; None builds the whole model.
        layers: Decoder layers of this stage; by default an even split.
        activation_checkpointing: Recompute every decoder layer in backward.
        attention_backend: Attention implementation; None auto-detects.
    """

    def __init__(
        self,
        config: DecoderFamily,
        *,
        stage: PipelineStageInfo | None = None,
        layers: range | None = None,
        activation_checkpointing: bool = False,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        super().__init__(
            config,
            stage=stage,
            layers=layers,
            activation_checkpointing=activation_checkpointing,
            attention_backend=attention_backend,
        )
        spec = self.spec
        self.lm_head = (
            LanguageModelHead(spec.hidden_size, spec.vocab_size, init_std=spec.initializer_range)
            if self.layout.is_last
            else None
        )
        self.tie_weights()

    def tie_weights(self) -> None:
        """Makes ``lm_head.weight`` the embedding's weight when tied and both are on this stage."""
        embedding = self.model.embed_tokens
        if self.spec.tie_word_embeddings and embedding is not None and self.lm_head is not None:
            weight = embedding.weight
            if not isinstance(weight, nn.Parameter):
                raise TypeError("the token embedding's weight is not a Parameter")
            self.lm_head.weight = weight

    def reset_parameters(self) -> None:
        """Re-initializes the backbone and the head (a tied head keeps the embedding's values)."""
        self.tie_weights()
        if self.lm_head is not None:
            self.lm_head.reset_parameters()
        super().reset_parameters()

    def forward(
        self, inputs: DecoderInputs | StageHandoff, shared: Any = None
    ) -> torch.Tensor | StageHandoff:
        """Per-token losses ``(batch, seq)`` on the last stage, the hand-off on the others.

        Args:
            inputs: ``DecoderInputs`` with ``labels`` (first stage) or the previous stage's hand-off.
            shared: Unused (d9d-loop's shared forward argument).
        """
        del shared
        handoff = self.run_backbone(inputs)
        if self.lm_head is None:
            return handoff
        labels, summed = handoff_labels(handoff)
        if labels is None:
            raise ValueError("the causal-LM forward computes the loss and needs DecoderInputs.labels")
        losses = self.lm_head(handoff["hidden_states"], labels, uniform_upstream_gradient=summed)
        auxiliary = self.load_balancing_loss(handoff)
        if auxiliary is None:
            return losses
        return attach_to_target_losses(losses, auxiliary, labels != -100)

    def loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean next-token loss of the whole model over positions whose target is not ``-100``.

        Args:
            input_ids: ``(batch, seq)`` tokens.
            labels: ``(batch, seq)`` per-position targets (see ``causal_lm_targets``).
            document_ids: Packed-document ids.
            position_ids: Positions (restarting per document when packed).
            attention_mask: Nonzero on real tokens; attention skips padding (left or right).
        """
        self.require_whole_model("loss")
        inputs = DecoderInputs(
            input_ids=input_ids,
            labels=labels,
            document_ids=document_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            summed_losses=True,
        )
        losses = self(inputs)
        if not isinstance(losses, torch.Tensor):
            raise TypeError("the whole model returned no losses")
        return losses.sum() / (labels != -100).sum().clamp(min=1)

    def logits(
        self,
        input_ids: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits ``(batch, seq, vocab)`` of the whole model (for inference).

        ``attention_mask`` (nonzero on real tokens) makes attention skip padding, left or right.
        """
        if self.lm_head is None:
            raise RuntimeError("logits needs the last stage (it holds the LM head)")
        hidden = self.hidden_states(
            input_ids, document_ids=document_ids, position_ids=position_ids, attention_mask=attention_mask
        )
        return self.lm_head.compute_logits(hidden)
