"""The model's shape for d9d-loop's memory estimate, from config.json alone (no weights fetched)."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from d9d.hf._decoder import read_config_file
from d9d.hf._families import DECODER_CONFIG_ADAPTER, SUPPORTED_MODEL_TYPES, AnyDecoderConfig
from d9d.hf._model_config import HFModelConfig, PretrainedModelConfig, ScratchModelConfig
from d9d.hf.qwen3 import Qwen3MoeConfig
from d9d.loop.estimate import LinearShape, ModelMemoryShape

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_LAYER = "model.layers.{layer}."


def _config_directory(source: str, revision: str | None) -> Path:
    path = Path(source)
    if path.is_dir():
        return path
    try:
        fetched = huggingface_hub.hf_hub_download(repo_id=source, filename="config.json", revision=revision)
    except (LocalEntryNotFoundError, HfHubHTTPError, ValueError) as e:
        raise FileNotFoundError(
            f"{source}: config.json cannot be read (a local directory or a Hub repo id): {e}"
        ) from None
    return Path(fetched).parent


def family_config(config: HFModelConfig) -> AnyDecoderConfig:
    """The config.json the model is built from: the source's (only that file) or ``model.config``."""
    match config:
        case PretrainedModelConfig():
            directory = _config_directory(config.source, config.revision)
            what = "model_type " + "/".join(SUPPORTED_MODEL_TYPES)
            return read_config_file(directory, DECODER_CONFIG_ADAPTER, what=what)
        case ScratchModelConfig():
            return config.config


def _linears(family: AnyDecoderConfig, head_dim: int) -> tuple[tuple[LinearShape, ...], int, int]:
    """Each layer's linear weights, other parameter elements and feed-forward width per token."""
    hidden, kv = family.hidden_size, family.num_key_value_heads or family.num_attention_heads
    q_width, kv_width = family.num_attention_heads * head_dim, kv * head_dim

    def linear(name: str, in_features: int, out_features: int, count: int = 1) -> LinearShape:
        return LinearShape(
            name=_LAYER + name,
            in_features=in_features,
            out_features=out_features,
            count=count,
            expert=count > 1,
        )

    attention = (
        linear("self_attn.q_proj", hidden, q_width),
        linear("self_attn.k_proj", hidden, kv_width),
        linear("self_attn.v_proj", hidden, kv_width),
        linear("self_attn.o_proj", q_width, hidden),
    )
    norms = 2 * hidden + 2 * head_dim
    if isinstance(family, Qwen3MoeConfig) and any(
        family.is_moe_layer(i) for i in range(family.num_hidden_layers)
    ):
        experts, width = family.experts, family.moe_intermediate_size
        mlp = (
            linear("mlp.experts.gate_proj", hidden, width, experts),
            linear("mlp.experts.up_proj", hidden, width, experts),
            linear("mlp.experts.down_proj", width, hidden, experts),
        )
        return attention + mlp, norms + hidden * experts, family.num_experts_per_tok * width
    width = family.intermediate_size
    mlp = (
        linear("mlp.gate_proj", hidden, width),
        linear("mlp.up_proj", hidden, width),
        linear("mlp.down_proj", width, hidden),
    )
    return attention + mlp, norms, width


def memory_shape(config: HFModelConfig, family: AnyDecoderConfig) -> ModelMemoryShape:
    """The estimate's statement of the model of ``config`` (a causal LM head, or a tied one).

    A Qwen3-MoE model is stated with experts in every layer (``mlp_only_layers`` are counted as
    sparse).
    """
    spec = family.decoder_spec()
    linears, other, ffn = _linears(family, spec.head_dim)
    storage = _BYTES[config.master_dtype]
    compute = _BYTES[config.compute_dtype] if config.compute_dtype is not None else storage
    return ModelMemoryShape(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        ffn_width=ffn,
        experts_per_token=family.num_experts_per_tok if isinstance(family, Qwen3MoeConfig) else 0,
        layer_linears=linears,
        layer_other_parameters=other,
        head=None
        if spec.tie_word_embeddings
        else LinearShape(name="lm_head", in_features=spec.hidden_size, out_features=spec.vocab_size),
        other_parameters=spec.hidden_size,
        storage_bytes=storage,
        compute_bytes=compute,
        activation_checkpointing=config.activation_checkpointing,
        last_stage_weight=config.last_stage_weight,
    )
