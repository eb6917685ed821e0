"""Gemma 3, text only: the family's config.json, layer recipe and name table."""

from d9d.hf.gemma3._config import Gemma3TextConfig, read_gemma3_text_config

__all__ = ["Gemma3TextConfig", "read_gemma3_text_config"]
