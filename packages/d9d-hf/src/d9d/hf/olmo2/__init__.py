"""OLMo 2: the family's config.json, layer recipe and name table."""

from d9d.hf.olmo2._config import Olmo2Config, read_olmo2_config

__all__ = ["Olmo2Config", "read_olmo2_config"]
