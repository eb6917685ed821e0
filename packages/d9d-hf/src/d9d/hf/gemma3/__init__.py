"""Gemma 3, text only: the family's config.json, decoder layer, name table and tensor-parallel plan."""

from d9d.hf.gemma3._config import Gemma3TextConfig, read_gemma3_text_config
from d9d.hf.gemma3._decoder_layer import Gemma3DecoderLayer
from d9d.hf.gemma3._tensor_parallel_plan import Gemma3DecoderPlan

__all__ = ["Gemma3DecoderLayer", "Gemma3DecoderPlan", "Gemma3TextConfig", "read_gemma3_text_config"]
