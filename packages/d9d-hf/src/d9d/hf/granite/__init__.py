"""Granite (IBM Granite 3.x dense): the family's config.json, decoder layer and name table."""

from d9d.hf.granite._config import GraniteConfig, read_granite_config
from d9d.hf.granite._decoder_layer import GraniteDecoderLayer

__all__ = ["GraniteConfig", "GraniteDecoderLayer", "read_granite_config"]
