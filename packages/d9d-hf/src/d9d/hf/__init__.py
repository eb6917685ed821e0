"""d9d Hugging Face interop: decoder models (Qwen3, Qwen3-MoE, Llama, Qwen2) from and to checkpoints."""

from d9d.hf._causal_lm_task import CausalLMState, CausalLMTask, TokenBatch, TokenSample, causal_lm_task
from d9d.hf._config_provider import provider_from_config
from d9d.hf._decoder import (
    DecoderBackbone,
    DecoderCausalLM,
    DecoderConfigBase,
    DecoderEmbedding,
    DecoderFamily,
    DecoderInputs,
    DecoderLayer,
    DecoderModelBase,
    DecoderSequenceClassification,
    DecoderSpec,
    LayerTensor,
    StackedExperts,
    StageHandoff,
    StageLayout,
    TensorName,
    attention_names,
    build_decoder,
    causal_lm_targets,
    decoder_export_mapper,
    decoder_load_mapper,
    dense_mlp_names,
    layer_windows,
    load_weights,
    parallelize_decoder,
)
from d9d.hf._families import DecoderConfig, read_decoder_config
from d9d.hf._head import HeadName
from d9d.hf._hub import SNAPSHOT_PATTERNS, resolve_snapshot
from d9d.hf._model_config import HFModelConfig, ParamDtype, PretrainedModelConfig, ScratchModelConfig
from d9d.hf._pretrained import load_pretrained, save_pretrained
from d9d.hf._provider import HFModelProvider
from d9d.hf._tied_embeddings import broadcast_tied_weight, sum_tied_gradients
from d9d.hf.llama import LlamaConfig
from d9d.hf.qwen2 import Qwen2Config
from d9d.hf.qwen3 import Qwen3DenseConfig, Qwen3MoeConfig

__all__ = [
    "SNAPSHOT_PATTERNS",
    "CausalLMState",
    "CausalLMTask",
    "DecoderBackbone",
    "DecoderCausalLM",
    "DecoderConfig",
    "DecoderConfigBase",
    "DecoderEmbedding",
    "DecoderFamily",
    "DecoderInputs",
    "DecoderLayer",
    "DecoderModelBase",
    "DecoderSequenceClassification",
    "DecoderSpec",
    "HFModelConfig",
    "HFModelProvider",
    "HeadName",
    "LlamaConfig",
    "LayerTensor",
    "ParamDtype",
    "PretrainedModelConfig",
    "Qwen2Config",
    "Qwen3DenseConfig",
    "Qwen3MoeConfig",
    "ScratchModelConfig",
    "StackedExperts",
    "StageHandoff",
    "StageLayout",
    "TensorName",
    "TokenBatch",
    "TokenSample",
    "attention_names",
    "broadcast_tied_weight",
    "build_decoder",
    "causal_lm_task",
    "causal_lm_targets",
    "decoder_export_mapper",
    "decoder_load_mapper",
    "dense_mlp_names",
    "layer_windows",
    "load_pretrained",
    "load_weights",
    "parallelize_decoder",
    "provider_from_config",
    "read_decoder_config",
    "resolve_snapshot",
    "save_pretrained",
    "sum_tied_gradients",
]
