"""The throughput benchmark's model shapes (config.json fields) and their training FLOPs per token.

A shape is a dict of Hugging Face config.json fields, fed unchanged to d9d's ``ScratchModelConfig``
and to transformers' config class; torchtitan's model arguments are derived from it.
"""

from __future__ import annotations

from typing import Any

DENSE_0_6B: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
}
MOE_30B_A3B_6_LAYERS: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
}
# Qwen3-4B's widths (and its tied head) cut to 12 of its 36 layers, so that torchtitan's bf16
# optimizer state and both jobs' activations fit one H200 at seq 4096 x batch 4 without recompute.
DENSE_4B_12_LAYERS: dict[str, Any] = {
    **DENSE_0_6B,
    "hidden_size": 2560,
    "num_hidden_layers": 12,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
}
# Qwen3-8B's widths (untied head) cut to 8 of its 36 layers: the larger dense shape of the FP8
# comparison (its 4096 x 12288 matmuls are where FP8 pays most), sized for one H200 at seq 4096 x
# batch 4 without recompute (d9d's float32 master weights and AdamW state: about 45 GiB).
DENSE_8B_8_LAYERS: dict[str, Any] = {
    **DENSE_0_6B,
    "hidden_size": 4096,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "tie_word_embeddings": False,
}
# The same widths with 16 of the 36 layers: the LM head (bf16 under FP8) has 16 % of the FLOPs instead
# of 27 % at 8 layers, nearer a whole 8B model (8 %); fits one H200 without recompute too.
DENSE_8B_16_LAYERS: dict[str, Any] = {**DENSE_8B_8_LAYERS, "num_hidden_layers": 16}
# Llama-3.2-1B's config.json (16 layers, tied head, llama3 RoPE scaling).
LLAMA_3_2_1B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rope_theta": 500_000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
}
# Gemma-3-1B's config.json (issue 45): 26 layers, five sliding (512-token window, local RoPE base
# 10k) to one global (1M), one key/value head of 256, the tied 262k-vocabulary head.
GEMMA_3_1B: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "intermediate_size": 6912,
    "vocab_size": 262144,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "layer_types": [],  # filled by model_shape: every SLIDING_PATTERN-th layer global
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
# Mistral-7B-v0.3's widths (untied 32k-vocabulary head, full attention: sliding_window null) cut
# to 8 of its 32 layers (issue 45).
MISTRAL_7B_8_LAYERS: dict[str, Any] = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 32768,
    "tie_word_embeddings": False,
    "sliding_window": None,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 32768,
}
# torchtitan's DeepSeek-V3 "16B" widths (DeepSeek-V2-Lite's: MLA without a q rank, kv rank 512,
# 64 routed experts top-6 and 2 shared, the first layer dense) cut to 6 of 27 layers, routed as
# DeepSeek-V3 (and Moonlight-16B-A3B) route: sigmoid scores renormalized over the top 6, one group
# (issue 46). Keys and values are per head (num_key_value_heads = num_attention_heads).
DEEPSEEK_16B_6_LAYERS: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "hidden_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "vocab_size": 102400,
    "tie_word_embeddings": False,
    "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
}
# GPT-OSS-20B's widths (32 experts top-4 of width 2880, 64 heads of 64, 8 key/value heads, sinks,
# 128-token sliding windows on even layers, YaRN RoPE: the config's defaults) cut to 6 of 24 layers
# (issue 46).
GPT_OSS_20B_6_LAYERS: dict[str, Any] = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "num_hidden_layers": 6,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 2880,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": [],  # filled by model_shape: even layers slide
    "vocab_size": 201088,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
}
SHAPES: dict[str, dict[str, Any]] = {
    "dense": DENSE_0_6B,
    "dense4b": DENSE_4B_12_LAYERS,
    "dense8b": DENSE_8B_8_LAYERS,
    "dense8b16": DENSE_8B_16_LAYERS,
    "moe": MOE_30B_A3B_6_LAYERS,
    "llama1b": LLAMA_3_2_1B,
    "gemma3_1b": GEMMA_3_1B,
    "mistral7b": MISTRAL_7B_8_LAYERS,
    "deepseek16b": DEEPSEEK_16B_6_LAYERS,
    "gptoss20b": GPT_OSS_20B_6_LAYERS,
}
SHAPE_HELP = (
    "dense: Qwen3-0.6B; dense4b: Qwen3-4B widths, 12 layers; dense8b: Qwen3-8B widths, 8 layers; "
    "dense8b16: the same, 16 layers; moe: Qwen3-30B-A3B widths, 6 layers; llama1b: Llama-3.2-1B; "
    "gemma3_1b: Gemma-3-1B; mistral7b: Mistral-7B-v0.3 widths, 8 layers; deepseek16b: torchtitan's "
    "DeepSeek-V3 16B widths (DeepSeek-V2-Lite's), 6 layers; gptoss20b: GPT-OSS-20B widths, 6 layers"
)
SLIDING_PATTERN: dict[str, int] = {"gemma3_text": 6, "gpt_oss": 2}
"""Every n-th layer attends globally, the others slide (Gemma 3: 5 local to 1 global; GPT-OSS: alternate)."""
QUICK: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,  # ZBV on 2 ranks builds 4 stages
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 8,
    "vocab_size": 256,
}


def model_shape(name: str, quick: bool) -> dict[str, Any]:
    """The shape ``name`` (tiny widths with ``quick``), its ``layer_types`` filled where it alternates."""
    shape = dict(SHAPES[name])
    if quick:
        shape.update({k: v for k, v in QUICK.items() if k in shape and shape[k] is not None})
    if shape["model_type"] == "deepseek_v3":  # MLA's keys and values are per head
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    if "layer_types" in shape:
        every = SLIDING_PATTERN[shape["model_type"]]
        shape["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(shape["num_hidden_layers"])
        ]
    return shape


def attended_keys(seq: int, window: int | None) -> float:
    """Keys a query attends to, averaged over a causal row of ``seq`` (within ``window`` if set).

    Full causal attention: ``seq / 2``. A window ``w < seq``: the mean of ``min(i, w)`` over
    positions, ``w - w^2 / (2 seq)`` in the same continuous count (equal to ``seq / 2`` at ``w = seq``).
    """
    if window is None or window >= seq:
        return seq / 2
    return window - window * window / (2 * seq)


def layer_windows(shape: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention)."""
    layers = shape["num_hidden_layers"]
    if "layer_types" in shape:
        return [shape["sliding_window"] if t == "sliding_attention" else None for t in shape["layer_types"]]
    if shape["model_type"] == "mistral":
        return [shape["sliding_window"]] * layers
    return [None] * layers


def _attention_matmul_params(shape: dict[str, Any]) -> int:
    """Weights of one layer's attention projections (MLA's low-rank ones for DeepSeek-V3)."""
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    if shape["model_type"] != "deepseek_v3":
        kv, dh = shape["num_key_value_heads"], shape["head_dim"]
        return h * heads * dh * 2 + h * kv * dh * 2
    nope, rope, v = shape["qk_nope_head_dim"], shape["qk_rope_head_dim"], shape["v_head_dim"]
    q_rank, kv_rank = shape["q_lora_rank"], shape["kv_lora_rank"]
    query = h * heads * (nope + rope) if q_rank is None else h * q_rank + q_rank * heads * (nope + rope)
    return query + h * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * h


def _attention_widths(shape: dict[str, Any]) -> tuple[int, int]:
    """(query/key width, value width) of one head."""
    if shape["model_type"] == "deepseek_v3":
        return shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"], shape["v_head_dim"]
    return shape["head_dim"], shape["head_dim"]


def _feed_forward_matmul_params(shape: dict[str, Any], index: int) -> int:
    """Active weights of layer ``index``'s feed-forward per token: router, chosen and shared experts."""
    h = shape["hidden_size"]
    match shape["model_type"]:
        case "qwen3_moe":
            experts, width = shape["num_experts"], shape["moe_intermediate_size"]
        case "gpt_oss":
            experts, width = shape["num_local_experts"], shape["intermediate_size"]
        case "deepseek_v3" if index >= shape["first_k_dense_replace"]:
            experts, width = shape["n_routed_experts"], shape["moe_intermediate_size"]
            shared = 3 * h * width * shape["n_shared_experts"]
            return h * experts + shape["num_experts_per_tok"] * 3 * h * width + shared
        case _:  # a dense (gated) feed-forward: gate, up, down
            return 3 * h * shape["intermediate_size"]
    return h * experts + shape["num_experts_per_tok"] * 3 * h * width


def active_matmul_params(shape: dict[str, Any], index: int) -> int:
    """The matmul weights one token meets in layer ``index``: attention projections, router, experts."""
    return _attention_matmul_params(shape) + _feed_forward_matmul_params(shape, index)


def flops_of_layers_and_head(shape: dict[str, Any], seq: int) -> tuple[list[float], float]:
    """Training FLOPs per token of each decoder layer (causal attention in its window) and of the LM head.

    ``6 x`` the matmul weights a token meets (forward 2, backward 4), plus the scores and the
    weighted values: ``6 x keys x heads x (qk width + v width)`` with ``keys`` the mean attended
    keys (``attended_keys``). Norms, biases, rotations, sinks and the softmax are left out.
    """
    heads = shape["num_attention_heads"]
    qk_width, v_width = _attention_widths(shape)
    layers = [
        float(
            6 * active_matmul_params(shape, index)
            + 6 * attended_keys(seq, window) * heads * (qk_width + v_width)
        )
        for index, window in enumerate(layer_windows(shape))
    ]
    return layers, float(6 * shape["hidden_size"] * shape["vocab_size"])


def flops_per_token(shape: dict[str, Any], seq: int) -> float:
    """Training FLOPs per token: every layer's and the LM head's."""
    layers, head = flops_of_layers_and_head(shape, seq)
    return sum(layers) + head
