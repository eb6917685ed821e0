"""Qwen2 / Qwen2.5 config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import TypeAdapter, model_validator

from d9d.hf._decoder import (
    DecoderConfigBase,
    DecoderTensorParallelPlan,
    LayerRecipe,
    LayerTensor,
    LayerType,
    MegatronDecoderPlan,
    layer_windows,
    read_config_file,
)
from d9d.hf.qwen2._layer_tensors import qwen2_layer_tensors


class Qwen2Config(DecoderConfigBase):
    """config.json of ``model_type: qwen2`` (``Qwen2ForCausalLM`` and its heads; Qwen2 and Qwen2.5).

    Sliding windows as transformers applies them: only with ``use_sliding_window``, on the layers
    ``layer_types`` marks (by default those from ``max_window_layers`` on).
    """

    architecture_prefix: ClassVar[str] = "Qwen2"

    model_type: Literal["qwen2"]
    vocab_size: int = 151936
    intermediate_size: int = 22016
    num_key_value_heads: int | None = 32
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[LayerType] | None = None
    use_mrope: Literal[False] | None = None  # in Qwen2.5 files; multimodal RoPE is Qwen2-VL's

    @model_validator(mode="after")
    def _layer_types_per_layer(self) -> Qwen2Config:
        self.windows()
        return self

    def windows(self) -> tuple[int | None, ...]:
        """Per layer, its attention window (None: full attention)."""
        return layer_windows(
            self.layer_types,
            window=self.sliding_window if self.use_sliding_window else None,
            max_window_layers=self.max_window_layers,
            num_layers=self.num_hidden_layers,
        )

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        """Qwen2's layers: separate q/k/v/o and gate/up/down projections (``MegatronDecoderPlan``)."""
        return MegatronDecoderPlan()

    def layer_recipe(self, index: int) -> LayerRecipe:
        """Qwen2's layer: biases on the q/k/v projections but not on ``o_proj``, layer ``index``'s window."""
        return dataclasses.replace(
            super().layer_recipe(index), qkv_bias=True, sliding_window=self.windows()[index]
        )

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """Qwen2's name table of layer ``index``."""
        del index
        return qwen2_layer_tensors()


QWEN2_CONFIG_ADAPTER: TypeAdapter[Qwen2Config] = TypeAdapter(Qwen2Config)


def read_qwen2_config(directory: Path | str) -> Qwen2Config:
    """Reads and validates ``directory/config.json`` as a Qwen2 config.

    Raises:
        ValueError: Naming the file and every offending field.
    """
    return read_config_file(directory, QWEN2_CONFIG_ADAPTER, what="Qwen2")
