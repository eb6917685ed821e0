"""d9d Hugging Face interop: Qwen3 models from config.json and safetensors checkpoints, and back."""

from d9d.hf._causal_lm_task import CausalLMState, CausalLMTask, TokenBatch, TokenSample, causal_lm_task
from d9d.hf._head import HeadName
from d9d.hf._hub import SNAPSHOT_PATTERNS, resolve_snapshot
from d9d.hf._model_config import HFModelConfig, ParamDtype, PretrainedModelConfig, ScratchModelConfig
from d9d.hf._pretrained import load_pretrained, save_pretrained
from d9d.hf._tied_embeddings import broadcast_tied_weight, sum_tied_gradients

__all__ = [
    "SNAPSHOT_PATTERNS",
    "CausalLMState",
    "CausalLMTask",
    "HFModelConfig",
    "HeadName",
    "ParamDtype",
    "PretrainedModelConfig",
    "ScratchModelConfig",
    "TokenBatch",
    "TokenSample",
    "broadcast_tied_weight",
    "causal_lm_task",
    "load_pretrained",
    "resolve_snapshot",
    "save_pretrained",
    "sum_tied_gradients",
]
