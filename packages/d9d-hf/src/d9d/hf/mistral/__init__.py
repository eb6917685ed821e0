"""Mistral (7B v0.1-v0.3, Nemo, Small): the family's config.json, decoder layer and name table."""

from d9d.hf.mistral._config import MistralConfig, read_mistral_config
from d9d.hf.mistral._decoder_layer import MistralDecoderLayer

__all__ = ["MistralConfig", "MistralDecoderLayer", "read_mistral_config"]
