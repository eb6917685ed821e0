"""Mistral (7B v0.1-v0.3, Nemo, Small): the family's config.json, layer recipe and name table."""

from d9d.hf.mistral._config import MistralConfig, read_mistral_config

__all__ = ["MistralConfig", "read_mistral_config"]
