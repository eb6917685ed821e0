"""A tiny Qwen3 causal LM shared by the d9d-rl tests."""

from __future__ import annotations

import torch

from d9d.hf import DecoderCausalLM
from d9d.hf.qwen3 import Qwen3DenseConfig

VOCAB = 48


def tiny_config(*, sliding_window: bool = True) -> Qwen3DenseConfig:
    """Two layers, GQA, q/k norms; layer 1 attends within a window of 4 positions."""
    return Qwen3DenseConfig.model_validate(
        {
            "model_type": "qwen3",
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "use_sliding_window": sliding_window,
            "sliding_window": 4,
            "max_window_layers": 1,
        }
    )


def tiny_model(seed: int = 0, *, sliding_window: bool = True) -> DecoderCausalLM:
    torch.manual_seed(seed)
    model = DecoderCausalLM(tiny_config(sliding_window=sliding_window), attention_backend="eager")
    model.reset_parameters()
    return model
