"""Granite (IBM Granite 3.x dense): the family's config.json, layer recipe and name table."""

from d9d.hf.granite._config import GraniteConfig, read_granite_config

__all__ = ["GraniteConfig", "read_granite_config"]
