"""Phi-3 (and Phi-3.5 / Phi-4 files of ``model_type: phi3``): config.json, layer recipe, name table."""

from d9d.hf.phi3._config import Phi3Config, read_phi3_config

__all__ = ["Phi3Config", "read_phi3_config"]
