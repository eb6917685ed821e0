"""A decoder as a text embedder (Qwen3-Embedding style: last-token pooling, L2-normalized)."""

from __future__ import annotations

from typing import Any

import torch

from d9d.hf._decoder._family import DecoderFamily
from d9d.hf._decoder._inputs import DecoderInputs, StageHandoff
from d9d.hf._decoder._model_base import DecoderModelBase
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, EmbeddingHead
from d9d.pipeline import PipelineStageInfo


class DecoderEmbedding(DecoderModelBase):
    """One L2-normalized vector per row: the final hidden state of the last real token.

    The head has no parameters; checkpoints are transformers' ``*Model`` (``Qwen3Model``, ...; no
    ``model.`` prefix), and any causal-LM or classification checkpoint loads with its head dropped.

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
        self.head = EmbeddingHead(self.spec.hidden_size, pooling="last") if self.layout.is_last else None

    def forward(
        self, inputs: DecoderInputs | StageHandoff, shared: Any = None
    ) -> torch.Tensor | StageHandoff:
        """Embeddings ``(batch, hidden)`` on the last stage, the hand-off on the others."""
        del shared
        handoff = self.run_backbone(inputs)
        if self.head is None:
            return handoff
        vectors = self.head(handoff["hidden_states"], handoff.get("attention_mask"))
        return self.attach_load_balancing_loss(vectors, handoff)

    def embed(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings ``(batch, hidden)`` of the whole model."""
        self.require_whole_model("embed")
        vectors = self(DecoderInputs(input_ids=input_ids, attention_mask=attention_mask))
        if not isinstance(vectors, torch.Tensor):
            raise TypeError("the whole model returned no embeddings")
        return vectors
