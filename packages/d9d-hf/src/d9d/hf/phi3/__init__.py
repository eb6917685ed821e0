"""Phi-3 (and Phi-3.5 / Phi-4 files of ``model_type: phi3``): config.json, decoder layer, name table."""

from d9d.hf.phi3._config import Phi3Config, read_phi3_config
from d9d.hf.phi3._decoder_layer import Phi3DecoderLayer

__all__ = ["Phi3Config", "Phi3DecoderLayer", "read_phi3_config"]
