"""Llama (3, 3.1, 3.2): the family's config.json, decoder layer and name table."""

from d9d.hf.llama._config import LlamaConfig, read_llama_config
from d9d.hf.llama._decoder_layer import LlamaDecoderLayer

__all__ = ["LlamaConfig", "LlamaDecoderLayer", "read_llama_config"]
