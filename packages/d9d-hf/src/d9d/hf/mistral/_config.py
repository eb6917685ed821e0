"""Mistral config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import TypeAdapter

from d9d.hf._decoder import (
    DecoderConfigBase,
    DecoderLayer,
    DecoderTensorParallelPlan,
    LayerTensor,
    MegatronDecoderPlan,
    read_config_file,
)
from d9d.hf.mistral._decoder_layer import MistralDecoderLayer
from d9d.hf.mistral._layer_tensors import mistral_layer_tensors
from d9d.kernels.layers import AttentionBackend, AttentionBackendName


class MistralConfig(DecoderConfigBase):
    """config.json of ``model_type: mistral`` (``MistralForCausalLM`` and its heads).

    ``sliding_window`` applies to every layer, as in transformers (``null``: full attention, as
    in Mistral 7B v0.2 and later). Alternating ``layer_types`` are Ministral's, not Mistral's:
    such a file is refused as an unknown field.
    """

    architecture_prefix: ClassVar[str] = "Mistral"

    model_type: Literal["mistral"]
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    max_position_embeddings: int = 131072
    sliding_window: int | None = 4096

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim``, else ``hidden_size // num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        """Mistral's layers: separate q/k/v/o and gate/up/down projections (``MegatronDecoderPlan``)."""
        return MegatronDecoderPlan()

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        """A ``MistralDecoderLayer`` (every layer is the same, window included)."""
        del index
        return MistralDecoderLayer(self, attention_backend=attention_backend)

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
