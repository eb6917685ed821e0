"""OLMo 2: the family's config.json, decoder layer and name table."""

from d9d.hf.olmo2._config import Olmo2Config, read_olmo2_config
from d9d.hf.olmo2._decoder_layer import Olmo2DecoderLayer

__all__ = ["Olmo2Config", "Olmo2DecoderLayer", "read_olmo2_config"]
