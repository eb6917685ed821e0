"""A decoder with a sequence-classification head (transformers' ``*ForSequenceClassification``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from d9d.hf._decoder._family import DecoderFamily
from d9d.hf._decoder._inputs import DecoderInputs, StageHandoff
from d9d.hf._decoder._model_base import DecoderModelBase
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, ClassificationHead
from d9d.pipeline import PipelineStageInfo


class DecoderSequenceClassification(DecoderModelBase):
    """Class logits from each row's last real token; ``score.classifier.weight`` is HF's ``score.weight``.

    The pooled token is the last one the ``attention_mask`` marks real, or without a mask the
    rightmost one that is not ``pad_token_id``, as transformers picks it; without either it is
    the row's last token. Padding may be on the left or the right: attention honours a given
    ``attention_mask`` (``DecoderInputs.attention_mask``). A left-padded batch needs that mask,
    as in transformers, where pad tokens are otherwise attended to. Packed rows are not
    supported: one sequence per row.

    Args:
        config: The model's config.json (``num_labels`` or ``id2label`` give the class count).
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
        self.score = (
            ClassificationHead(
                spec.hidden_size, spec.num_labels, pooling="last", bias=False, init_std=spec.initializer_range
            )
            if self.layout.is_last
            else None
        )

    def reset_parameters(self) -> None:
        """Re-initializes the backbone and the classifier."""
        super().reset_parameters()
        if self.score is not None:
            self.score.reset_parameters()

    def prepare_inputs(self, inputs: DecoderInputs) -> DecoderInputs:
        """Derives the padding mask from ``pad_token_id`` when none is given."""
        pad = self.spec.pad_token_id
        if inputs.attention_mask is not None or pad is None:
            return inputs
        return dataclasses.replace(inputs, attention_mask=(inputs.input_ids != pad).to(torch.int64))

    def forward(
        self, inputs: DecoderInputs | StageHandoff, shared: Any = None
    ) -> torch.Tensor | StageHandoff:
        """Class logits ``(batch, num_labels)`` on the last stage, the hand-off on the others."""
        del shared
        handoff = self.run_backbone(inputs)
        if self.score is None:
            return handoff
        logits = self.score(handoff["hidden_states"], handoff.get("attention_mask"))
        return self.attach_load_balancing_loss(logits, handoff)

    def classify(
        self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Class logits ``(batch, num_labels)`` of the whole model."""
        self.require_whole_model("classify")
        logits = self(DecoderInputs(input_ids=input_ids, attention_mask=attention_mask))
        if not isinstance(logits, torch.Tensor):
            raise TypeError("the whole model returned no logits")
        return logits
