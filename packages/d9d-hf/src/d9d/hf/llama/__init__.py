"""Llama (3, 3.1, 3.2): the family's config.json, layer recipe and name table."""

from d9d.hf.llama._config import LlamaConfig, read_llama_config

__all__ = ["LlamaConfig", "read_llama_config"]
