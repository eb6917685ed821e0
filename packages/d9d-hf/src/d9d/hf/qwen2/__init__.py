"""Qwen2 and Qwen2.5: the family's config.json, layer recipe and name table."""

from d9d.hf.qwen2._config import Qwen2Config, read_qwen2_config

__all__ = ["Qwen2Config", "read_qwen2_config"]
