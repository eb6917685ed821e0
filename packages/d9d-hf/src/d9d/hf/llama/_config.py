"""Llama config.json (Llama 3, 3.1, 3.2), read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import TypeAdapter

from d9d.hf._decoder import (
    DecoderConfigWithHeadDim,
    DecoderTensorParallelPlan,
    LayerRecipe,
    LayerTensor,
    MegatronDecoderPlan,
    read_config_file,
)
from d9d.hf.llama._layer_tensors import llama_layer_tensors


class LlamaConfig(DecoderConfigWithHeadDim):
    """config.json of ``model_type: llama`` (``LlamaForCausalLM`` and its heads).

    Llama 3.1 and 3.2 carry ``rope_scaling: {rope_type: llama3, ...}`` (or ``rope_parameters``
    in newer files); Llama 3.2 1B/3B tie the LM head to the embedding. ``pretraining_tp`` only
    split the original matmuls and changes nothing here.
    """

    architecture_prefix: ClassVar[str] = "Llama"

    model_type: Literal["llama"]
    pretraining_tp: int | None = 1
    attention_bias: bool = False
    mlp_bias: bool = False

    def layer_recipe(self, index: int) -> LayerRecipe:
        """Llama's layer: biases on q/k/v/o with ``attention_bias``, on the MLP with ``mlp_bias``."""
        return dataclasses.replace(
            super().layer_recipe(index),
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
        )

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        """Llama's layers: separate q/k/v/o and gate/up/down projections (``MegatronDecoderPlan``)."""
        return MegatronDecoderPlan()

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """Llama's name table of layer ``index``."""
        del index
        return llama_layer_tensors(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)


LLAMA_CONFIG_ADAPTER: TypeAdapter[LlamaConfig] = TypeAdapter(LlamaConfig)


def read_llama_config(directory: Path | str) -> LlamaConfig:
    """Reads and validates ``directory/config.json`` as a Llama config.

    Raises:
        ValueError: Naming the file and every offending field.
    """
    return read_config_file(directory, LLAMA_CONFIG_ADAPTER, what="Llama")
