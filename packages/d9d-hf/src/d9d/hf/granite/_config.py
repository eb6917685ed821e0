"""Granite config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, TypeAdapter

from d9d.hf._decoder import (
    DecoderConfigBase,
    DecoderSpec,
    DecoderTensorParallelPlan,
    LayerRecipe,
    LayerTensor,
    MegatronDecoderPlan,
    read_config_file,
)
from d9d.hf.granite._layer_tensors import granite_layer_tensors


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

    def layer_recipe(self, index: int) -> LayerRecipe:
        """Granite's layer: Llama's biases, scores times ``attention_multiplier`` (in place of
        ``head_dim ** -0.5``), each branch times ``residual_multiplier`` as it joins the residual."""
        return dataclasses.replace(
            super().layer_recipe(index),
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            softmax_scale=self.attention_multiplier,
            residual_multiplier=self.residual_multiplier,
        )

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
