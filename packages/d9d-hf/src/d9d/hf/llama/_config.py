"""Llama config.json (Llama 3, 3.1, 3.2), read and written (pydantic, the Hugging Face field names)."""

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
from d9d.hf.llama._decoder_layer import LlamaDecoderLayer
from d9d.hf.llama._layer_tensors import llama_layer_tensors
from d9d.kernels.layers import AttentionBackend, AttentionBackendName


class LlamaConfig(DecoderConfigBase):
    """config.json of ``model_type: llama`` (``LlamaForCausalLM`` and its heads).

    Llama 3.1 and 3.2 carry ``rope_scaling: {rope_type: llama3, ...}`` (or ``rope_parameters``
    in newer files); Llama 3.2 1B/3B tie the LM head to the embedding. ``pretraining_tp`` only
    split the original matmuls and changes nothing here.
    """

    architecture_prefix: ClassVar[str] = "Llama"

    model_type: Literal["llama"]
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    pretraining_tp: int | None = 1
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim``, else ``hidden_size // num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        """Llama's layers: separate q/k/v/o and gate/up/down projections (``MegatronDecoderPlan``)."""
        return MegatronDecoderPlan()

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        """A ``LlamaDecoderLayer`` (every layer is the same)."""
        del index
        return LlamaDecoderLayer(self, attention_backend=attention_backend)

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
