"""A decoder of any family with several heads on one backbone (all on the last pipeline stage)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from d9d.hf._decoder._auxiliary_loss import attach_to_target_losses
from d9d.hf._decoder._family import DecoderFamily
from d9d.hf._decoder._head_specs import (
    ClassificationHeadSpec,
    HeadSpec,
    LanguageModelHeadSpec,
    check_head_specs,
)
from d9d.hf._decoder._inputs import DecoderInputs, StageHandoff, handoff_labels
from d9d.hf._decoder._model_base import DecoderModelBase
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, ClassificationHead, LanguageModelHead
from d9d.pipeline import PipelineStageInfo

MultiHeadOutput = dict[str, torch.Tensor]
"""The last stage's output: per head name, the language-model head's per-token losses
``(batch, seq)`` or a classification head's logits ``(batch, num_labels)``."""


class DecoderMultiHead(DecoderModelBase):
    """A decoder with several heads on one backbone; the last stage returns every head's output.

    State names: the backbone's as in every decoder model (``model.*``), the language-model head
    as transformers' ``lm_head.weight`` (tied to the embedding when the config says so), each
    classification head under ``heads.<name>.classifier.weight``. Every head reads the final
    normalized hidden states; the classification heads pool each row's last real token (the
    padding mask is derived from ``pad_token_id`` when the batch has none), so rows are one
    sequence each when a classification head is present.

    On MoE layers the load-balancing loss is attached once, to the first head's output (as the
    single-head models attach it), so the task's weight of that head's loss scales it too.

    Args:
        config: The model's config.json (a family's config model).
        heads: The heads, in output order (see ``check_head_specs``).
        stage: The pipeline stage to build; None builds the whole model.
        layers: Decoder layers of this stage; by default an even split.
        activation_checkpointing: Recompute every decoder layer in backward.
        attention_backend: Attention implementation; None auto-detects.
    """

    def __init__(
        self,
        config: DecoderFamily,
        heads: Sequence[HeadSpec],
        *,
        stage: PipelineStageInfo | None = None,
        layers: range | None = None,
        activation_checkpointing: bool = False,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        check_head_specs(list(heads))
        super().__init__(
            config,
            stage=stage,
            layers=layers,
            activation_checkpointing=activation_checkpointing,
            attention_backend=attention_backend,
        )
        self.head_specs: tuple[HeadSpec, ...] = tuple(heads)
        spec = self.spec
        last = self.layout.is_last
        self.lm_head: LanguageModelHead | None = None
        if last and self.language_model_head is not None:
            self.lm_head = LanguageModelHead(
                spec.hidden_size, spec.vocab_size, init_std=spec.initializer_range
            )
        self.heads = nn.ModuleDict()
        if last:
            for head in self.classification_heads:
                self.heads[head.name] = ClassificationHead(
                    spec.hidden_size,
                    head.num_labels,
                    pooling="last",
                    bias=False,
                    init_std=spec.initializer_range,
                )
        self.tie_weights()

    @property
    def language_model_head(self) -> LanguageModelHeadSpec | None:
        """The language-model head's spec, or None."""
        for head in self.head_specs:
            if isinstance(head, LanguageModelHeadSpec):
                return head
        return None

    @property
    def classification_heads(self) -> list[ClassificationHeadSpec]:
        """The classification heads' specs, in order."""
        return [head for head in self.head_specs if isinstance(head, ClassificationHeadSpec)]

    def tie_weights(self) -> None:
        """Makes ``lm_head.weight`` the embedding's weight when tied and both are on this stage."""
        embedding = self.model.embed_tokens
        if self.spec.tie_word_embeddings and embedding is not None and self.lm_head is not None:
            weight = embedding.weight
            if not isinstance(weight, nn.Parameter):
                raise TypeError("the token embedding's weight is not a Parameter")
            self.lm_head.weight = weight

    def reset_heads(self, *, language_model: bool) -> None:
        """Re-initializes every classification head, and the language-model head if ``language_model``."""
        for head in self.heads.values():
            if isinstance(head, ClassificationHead):
                head.reset_parameters()
        if language_model and self.lm_head is not None:
            self.lm_head.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initializes the backbone and every head (a tied LM head keeps the embedding's values)."""
        self.tie_weights()
        self.reset_heads(language_model=True)
        super().reset_parameters()

    def prepare_inputs(self, inputs: DecoderInputs) -> DecoderInputs:
        """With a classification head: derives the padding mask from ``pad_token_id`` when none is given."""
        pad = self.spec.pad_token_id
        if not self.classification_heads or inputs.attention_mask is not None or pad is None:
            return inputs
        return dataclasses.replace(inputs, attention_mask=(inputs.input_ids != pad).to(torch.int64))

    def _head_output(self, head: HeadSpec, handoff: StageHandoff) -> torch.Tensor:
        hidden = handoff["hidden_states"]
        match head:
            case LanguageModelHeadSpec():
                labels, summed = handoff_labels(handoff)
                if labels is None or self.lm_head is None:
                    raise ValueError(f"the causal_lm head {head.name!r} needs DecoderInputs.labels")
                return self.lm_head(hidden, labels, uniform_upstream_gradient=summed)
            case ClassificationHeadSpec():
                classify = self.heads[head.name]
                if not isinstance(classify, ClassificationHead):
                    raise TypeError(f"head {head.name!r} is not a ClassificationHead")
                if hidden.is_meta:  # the pipeline's shape pass: pooling reads the mask's values
                    return classify.classifier(hidden[:, -1])
                return classify(hidden, handoff.get("attention_mask"))

    def forward(
        self, inputs: DecoderInputs | StageHandoff, shared: Any = None
    ) -> MultiHeadOutput | StageHandoff:
        """Every head's output by name on the last stage (``MultiHeadOutput``), the hand-off on the others.

        Args:
            inputs: ``DecoderInputs`` (with ``labels`` when there is a language-model head) on the
                first stage, the previous stage's hand-off on the others.
            shared: Unused (d9d-loop's shared forward argument).
        """
        del shared
        handoff = self.run_backbone(inputs)
        if not self.layout.is_last:
            return handoff
        outputs = {head.name: self._head_output(head, handoff) for head in self.head_specs}
        auxiliary = self.load_balancing_loss(handoff)
        if auxiliary is not None:
            first = self.head_specs[0]
            targets = None
            if isinstance(first, LanguageModelHeadSpec):
                labels, _ = handoff_labels(handoff)
                targets = None if labels is None else labels != -100
            outputs[first.name] = attach_to_target_losses(outputs[first.name], auxiliary, targets)
        return outputs

    def outputs(
        self,
        input_ids: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> MultiHeadOutput:
        """Every head's output of the whole model (see ``forward``)."""
        self.require_whole_model("outputs")
        return self(DecoderInputs(input_ids=input_ids, labels=labels, attention_mask=attention_mask))
