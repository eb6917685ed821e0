"""Qwen3 and Qwen3-MoE: config.json, models on d9d-kernels layers, Hugging Face state mappers."""

from d9d.hf.qwen3._backbone import Qwen3Backbone
from d9d.hf.qwen3._causal_lm import Qwen3CausalLM
from d9d.hf.qwen3._checkpoint import (
    build_qwen3,
    check_checkpoint,
    export_config,
    head_of,
    hf_architecture,
    load_qwen3_weights,
    read_qwen3_config,
    write_config,
)
from d9d.hf.qwen3._config import Qwen3Config, Qwen3DenseConfig, Qwen3MoeConfig, qwen3_spec
from d9d.hf.qwen3._decoder_layer import Qwen3DecoderLayer
from d9d.hf.qwen3._embedding import Qwen3Embedding
from d9d.hf.qwen3._inputs import Qwen3Inputs, StageHandoff, causal_lm_targets
from d9d.hf.qwen3._model_base import Qwen3ModelBase
from d9d.hf.qwen3._parallelize import parallelize_qwen3
from d9d.hf.qwen3._provider import Qwen3ModelProvider
from d9d.hf.qwen3._sequence_classification import Qwen3SequenceClassification
from d9d.hf.qwen3._spec import Qwen3MoeSpec, Qwen3Spec
from d9d.hf.qwen3._stage import StageLayout, stage_layout
from d9d.hf.qwen3._state_mapper import qwen3_export_mapper, qwen3_load_mapper
from d9d.hf.qwen3._tensor_parallel import parallelize_qwen3_tensor_parallel

__all__ = [
    "Qwen3Backbone",
    "Qwen3CausalLM",
    "Qwen3Config",
    "Qwen3DecoderLayer",
    "Qwen3DenseConfig",
    "Qwen3Embedding",
    "Qwen3Inputs",
    "Qwen3ModelBase",
    "Qwen3ModelProvider",
    "Qwen3MoeConfig",
    "Qwen3MoeSpec",
    "Qwen3SequenceClassification",
    "Qwen3Spec",
    "StageHandoff",
    "StageLayout",
    "build_qwen3",
    "causal_lm_targets",
    "check_checkpoint",
    "export_config",
    "head_of",
    "hf_architecture",
    "load_qwen3_weights",
    "parallelize_qwen3",
    "parallelize_qwen3_tensor_parallel",
    "qwen3_export_mapper",
    "qwen3_load_mapper",
    "qwen3_spec",
    "read_qwen3_config",
    "stage_layout",
    "write_config",
]
