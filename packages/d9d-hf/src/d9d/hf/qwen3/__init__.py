"""Qwen3 and Qwen3-MoE: the family's config.json, layer recipe and name table.

The models, loading, parallelism and the provider are the decoder core's, shared by every
family: ``d9d.hf.DecoderCausalLM``, ``d9d.hf.HFModelProvider``, ``d9d.hf.parallelize_decoder``, ...
"""

from d9d.hf.qwen3._config import (
    Qwen3Config,
    Qwen3DenseConfig,
    Qwen3MoeConfig,
    hf_architecture,
    qwen3_spec,
    read_qwen3_config,
)
from d9d.hf.qwen3._spec import Qwen3MoeSpec, Qwen3Spec

__all__ = [
    "Qwen3Config",
    "Qwen3DenseConfig",
    "Qwen3MoeConfig",
    "Qwen3MoeSpec",
    "Qwen3Spec",
    "hf_architecture",
    "qwen3_spec",
    "read_qwen3_config",
]
