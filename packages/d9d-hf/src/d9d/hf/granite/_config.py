"""Granite config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, TypeAdapter

from d9d.hf._decoder import (
    DecoderConfigBase,
    DecoderLayer,
    DecoderSpec,
    DecoderTensorParallelPlan,
    LayerTensor,
    MegatronDecoderPlan,
    read_config_file,
)
from d9d.hf.granite._decoder_layer import GraniteDecoderLayer
from d9d.hf.granite._layer_tensors import granite_layer_tensors
from d9d.kernels.layers import AttentionBackend, AttentionBackendName


class GraniteConfig(DecoderConfigBase):
    """config.json of ``model_type: granite`` (``GraniteForCausalLM`` and its heads; Granite 3.x dense).

    Llama's layout with four multipliers, as transformers applies them: the token embeddings
    times ``embedding_multiplier``; attention scores times ``attention_multiplier`` (instead of
    ``1 / sqrt(head_dim)``); each attention and MLP output times ``residual_multiplier`` before
    the residual add; the causal LM's logits divided by ``logits_scaling`` (transformers'
    sequence-classification and base models do not divide, and neither does d9d).
    """

    architecture_prefix: ClassVar[str] = "Granite"

    model_type: Literal["granite"]
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    embedding_multiplier: float = 1.0
    logits_scaling: float = Field(default=1.0, gt=0)
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0

    def decoder_spec(self) -> DecoderSpec:
        """The shared numbers, with the embedding multiplier and the logits' ``1 / logits_scaling``."""
        return dataclasses.replace(
            super().decoder_spec(),
            embedding_multiplier=self.embedding_multiplier,
            logits_multiplier=1.0 / self.logits_scaling,
        )

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        """Granite's layers: separate q/k/v/o and gate/up/down projections (``MegatronDecoderPlan``)."""
        return MegatronDecoderPlan()

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        """A ``GraniteDecoderLayer`` (every layer is the same)."""
        del index
        return GraniteDecoderLayer(self, attention_backend=attention_backend)

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """Granite's name table of layer ``index``."""
        del index
        return granite_layer_tensors(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)


GRANITE_CONFIG_ADAPTER: TypeAdapter[GraniteConfig] = TypeAdapter(GraniteConfig)


def read_granite_config(directory: Path | str) -> GraniteConfig:
    """Reads and validates ``directory/config.json`` as a Granite config.

    Raises:
        ValueError: Naming the file and every offending field.
    """
    return read_config_file(directory, GRANITE_CONFIG_ADAPTER, what="Granite")
