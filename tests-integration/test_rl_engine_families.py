"""d9d-rl's embedded engine on every d9d-hf family: KV-cached greedy decoding equals the uncached model.

The engine is typed by d9d-hf's core (``DecoderCausalLM``), so a model of any family fits; this
runs the real producer (each family's layer: q/k norms or none, q/k/v biases, an output bias or
none, llama3 rope scaling, sliding windows, OLMo 2's post-norms, Granite's multipliers, Gemma 3's
per-layer rope bases) through the real consumer (the engine's cache).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from d9d.hf import (
    DecoderCausalLM,
    DecoderFamily,
    DeepseekV3Config,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3DenseConfig,
)
from d9d.rl import EmbeddedRolloutEngine, SamplingParams

TINY: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
FAMILIES: list[DecoderFamily] = [
    Qwen3DenseConfig.model_validate(
        {**TINY, "model_type": "qwen3", "head_dim": 8, "use_sliding_window": True, "sliding_window": 3}
    ),
    LlamaConfig.model_validate(
        {**TINY, "model_type": "llama", "rope_scaling": LLAMA3_ROPE, "attention_bias": True}
    ),
    Qwen2Config.model_validate(
        {
            **TINY,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 3,
            "max_window_layers": 1,
        }
    ),
    # post-norms, q/k norms over all heads, biases on q/k/v/o
    Olmo2Config.model_validate({**TINY, "model_type": "olmo2", "attention_bias": True}),
    MistralConfig.model_validate({**TINY, "model_type": "mistral", "sliding_window": 3}),
    # the checkpoint's fused qkv/gate_up are split on load: the model is Llama's with a window
    Phi3Config.model_validate({**TINY, "model_type": "phi3", "sliding_window": 3, "pad_token_id": 0}),
    # Phi-4-mini's partial rotary: the leading three quarters of each head rotated, the rest passed
    Phi3Config.model_validate(
        {**TINY, "model_type": "phi3", "partial_rotary_factor": 0.75, "pad_token_id": 0}
    ),
    # the embedding, score, residual and logits multipliers
    GraniteConfig.model_validate(
        {
            **TINY,
            "model_type": "granite",
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.3,
            "residual_multiplier": 0.22,
            "logits_scaling": 4.0,
        }
    ),
    # a local layer (window, its own rope base) then a global one (linear rope), 1 + w norms, GeGLU
    Gemma3TextConfig.model_validate(
        {
            **TINY,
            "model_type": "gemma3_text",
            "head_dim": 8,
            "query_pre_attn_scalar": 6,
            "sliding_window": 3,
            "sliding_window_pattern": 2,
            "rope_theta": 100000.0,
            "rope_local_base_freq": 50.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        }
    ),
    # attention sinks on a sliding then a full layer, q/k/v/o biases, biased router and experts
    GptOssConfig.model_validate(
        {
            **TINY,
            "model_type": "gpt_oss",
            "head_dim": 8,
            "sliding_window": 3,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        }
    ),
    # MLA (low-rank q/kv, interleaved rope, values narrower than q/k: zero-padded in the cache),
    # a dense layer, then sigmoid group-limited routing with a selection bias and shared experts
    DeepseekV3Config.model_validate(
        {
            **TINY,
            "model_type": "deepseek_v3",
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 8,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 6,
        }
    ),
]
PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 6]]  # ragged: left padding matters


def _assert_cached_greedy_equals_uncached(model: DecoderCausalLM, prompts: list[list[int]]) -> None:
    """Each of the engine's greedy tokens is the uncached model's argmax after the tokens before it."""
    completions = EmbeddedRolloutEngine(model).generate(
        prompts, SamplingParams(max_tokens=6, temperature=0.0)
    )
    for completion in completions:
        ids = list(prompts[completion.prompt_index])
        for token in completion.token_ids:
            with torch.no_grad():
                logits = model.logits(torch.tensor([ids]))
            assert int(logits[0, -1].argmax()) == token
            ids.append(token)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: type(family).__name__)
def test_cached_greedy_decoding_equals_the_uncached_model(family: DecoderFamily) -> None:
    torch.manual_seed(0)
    model = DecoderCausalLM(family, attention_backend="eager")
    with torch.no_grad():  # biases (and sinks) away from their initialization, so a dropped one shows
        for name, parameter in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                parameter.normal_()
    _assert_cached_greedy_equals_uncached(model, PROMPTS)


def test_longrope_rows_past_the_original_context_decode_as_the_uncached_model() -> None:
    """Phi-4-mini's shape (LongRoPE over three quarters of each head): every row starts past the
    original context, so the cache's keys and the uncached model's use the same long factors."""
    family = Phi3Config.model_validate(
        {
            **TINY,
            "model_type": "phi3",
            "pad_token_id": 0,
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 6,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.3, 1.7],
                "long_factor": [2.0, 5.0, 9.0],
            },
        }
    )
    torch.manual_seed(0)
    model = DecoderCausalLM(family, attention_backend="eager")
    prompts = [[3, 7, 1, 9, 9, 9, 9, 2], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    _assert_cached_greedy_equals_uncached(model, prompts)
