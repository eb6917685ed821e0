"""Mistral config.json, read and written (pydantic, the Hugging Face field names)."""

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
from d9d.hf.mistral._layer_tensors import mistral_layer_tensors


class MistralConfig(DecoderConfigWithHeadDim):
    """config.json of ``model_type: mistral`` (``MistralForCausalLM`` and its heads).

    ``sliding_window`` applies to every layer, as in transformers (``null``: full attention, as
    in Mistral 7B v0.2 and later). Alternating ``layer_types`` are Ministral's, not Mistral's:
    such a file is refused as an unknown field.
    """

    architecture_prefix: ClassVar[str] = "Mistral"

    model_type: Literal["mistral"]
    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 131072
    sliding_window: int | None = 4096

    def layer_recipe(self, index: int) -> LayerRecipe:
        """Mistral's layer: no biases, no q/k norms, ``sliding_window`` (when set) on every layer."""
        return dataclasses.replace(super().layer_recipe(index), sliding_window=self.sliding_window)

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        """Mistral's layers: separate q/k/v/o and gate/up/down projections (``MegatronDecoderPlan``)."""
        return MegatronDecoderPlan()

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """Mistral's name table of layer ``index``."""
        del index
        return mistral_layer_tensors()


MISTRAL_CONFIG_ADAPTER: TypeAdapter[MistralConfig] = TypeAdapter(MistralConfig)


def read_mistral_config(directory: Path | str) -> MistralConfig:
    """Reads and validates ``directory/config.json`` as a Mistral config.

    Raises:
        ValueError: Naming the file and every offending field.
    """
    return read_config_file(directory, MISTRAL_CONFIG_ADAPTER, what="Mistral")
