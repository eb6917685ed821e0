"""Qwen2 and Qwen2.5: the family's config.json, decoder layer and name table."""

from d9d.hf.qwen2._config import Qwen2Config, read_qwen2_config
from d9d.hf.qwen2._decoder_layer import Qwen2DecoderLayer

__all__ = ["Qwen2Config", "Qwen2DecoderLayer", "read_qwen2_config"]
