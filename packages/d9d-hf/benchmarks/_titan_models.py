"""torchtitan 0.2.2's own models at a benchmark shape, from its model arguments, compiled as its trainer does.

Each builder starts from one of torchtitan's named configurations and replaces the widths with the
shape's, so whatever the shape does not say stays torchtitan's. torchtitan is optional: without it
``require_torchtitan`` raises ``PeerNotInstalledError``, which the benchmark reports as a row.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any

import torch

TORCHTITAN_VERSION = "0.2.2"
TITAN_FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss")
"""The model types whose torchtitan model ``titan_model`` builds."""


class PeerNotInstalledError(RuntimeError):
    """A peer implementation's package is missing; the benchmark prints a row saying so."""


def require_torchtitan() -> None:
    """Raises ``PeerNotInstalledError`` unless ``torchtitan`` imports."""
    if importlib.util.find_spec("torchtitan") is None:
        raise PeerNotInstalledError(
            f"torchtitan is not installed (the titan rows need torchtitan {TORCHTITAN_VERSION}: "
            f"pip install torchtitan=={TORCHTITAN_VERSION})"
        )


def titan_llama3(shape: dict[str, Any], seq: int) -> torch.nn.Module:
    """torchtitan's llama3 Transformer at ``shape`` (its MLP width from multiplier and rounding)."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    dim, hidden = shape["hidden_size"], shape["intermediate_size"]
    if shape["head_dim"] != dim // shape["num_attention_heads"]:
        raise ValueError("torchtitan's llama3 derives head_dim as hidden_size / num_attention_heads")
    # torchtitan sizes the MLP as multiple_of x ceil(multiplier x int(8 dim / 3) / multiple_of)
    multiple_of = math.gcd(hidden, 256)
    multiplier = hidden / int(8 * dim / 3)
    scaling = shape["rope_scaling"]
    model_args = TransformerModelArgs(
        dim=dim,
        n_layers=shape["num_hidden_layers"],
        n_heads=shape["num_attention_heads"],
        n_kv_heads=shape["num_key_value_heads"],
        vocab_size=shape["vocab_size"],
        multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier,
        norm_eps=shape["rms_norm_eps"],
        rope_theta=shape["rope_theta"],
        rope_scaling_args=RoPEScalingArgs(
            scaling_factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
        ),
        max_seq_len=seq,
    )
    with torch.device("meta"):
        model = Transformer(model_args)
    widths = {m.w1.out_features for m in model.modules() if hasattr(m, "w1")}
    if widths != {hidden}:
        raise ValueError(f"torchtitan's llama3 MLP width came out {widths}, not {hidden}")
    return model


def titan_qwen3(shape: dict[str, Any], seq: int) -> torch.nn.Module:
    """torchtitan's Qwen3 model (dense from "0.6B", MoE from "30B-A3B") at ``shape``'s widths."""
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    base = qwen3_args["0.6B" if shape["model_type"] == "qwen3" else "30B-A3B"]
    model_args = dataclasses.replace(
        base,
        n_layers=shape["num_hidden_layers"],
        dim=shape["hidden_size"],
        n_heads=shape["num_attention_heads"],
        n_kv_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        hidden_dim=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
        max_seq_len=seq,
        enable_weight_tying=shape["tie_word_embeddings"],
    )
    with torch.device("meta"):
        return Qwen3Model(model_args)


def _as_trainer_sets(model_args: Any, seq: int) -> Any:
    """``model_args`` after ``update_from_config`` with a default job at ``seq``, as its trainer builds them.

    (It sets what the model needs and the dataclass leaves unset, DeepSeek-V3's ``moe_impl``
    among them, and turns grouped GEMMs off below SM90.)
    """
    from torchtitan.config.job_config import JobConfig

    job = JobConfig()
    job.training.seq_len = seq
    model_args.update_from_config(job)
    return model_args


def titan_deepseek_v3(shape: dict[str, Any], seq: int) -> torch.nn.Module:
    """torchtitan's DeepSeek-V3 model from its "16B" arguments at ``shape``'s widths and routing.

    SDPA with a causal mask (d9d's rows run SDPA on rows of one document too), and no YaRN:
    ``original_seq_len`` at least ``seq``, as the shape has no ``rope_scaling``.
    """
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args

    base = deepseekv3_args["16B"]
    grouped = shape["n_group"] > 1
    moe_args = dataclasses.replace(
        base.moe_args,
        num_experts=shape["n_routed_experts"],
        num_shared_experts=shape["n_shared_experts"],
        top_k=shape["num_experts_per_tok"],
        score_func="sigmoid",
        route_norm=shape["norm_topk_prob"],
        route_scale=shape["routed_scaling_factor"],
        num_expert_groups=shape["n_group"] if grouped else None,
        num_limited_groups=shape["topk_group"] if grouped else None,
    )
    model_args = dataclasses.replace(
        base,
        vocab_size=shape["vocab_size"],
        dim=shape["hidden_size"],
        inter_dim=shape["intermediate_size"],
        moe_inter_dim=shape["moe_intermediate_size"],
        n_layers=shape["num_hidden_layers"],
        n_dense_layers=shape["first_k_dense_replace"],
        n_heads=shape["num_attention_heads"],
        norm_eps=shape["rms_norm_eps"],
        moe_args=moe_args,
        q_lora_rank=shape["q_lora_rank"] or 0,
        kv_lora_rank=shape["kv_lora_rank"],
        qk_nope_head_dim=shape["qk_nope_head_dim"],
        qk_rope_head_dim=shape["qk_rope_head_dim"],
        v_head_dim=shape["v_head_dim"],
        attn_type="sdpa",
        attn_mask_type="causal",
        rope_theta=shape["rope_theta"],
        max_seq_len=seq,
        original_seq_len=max(seq, base.original_seq_len),
    )
    with torch.device("meta"):
        return DeepSeekV3Model(_as_trainer_sets(model_args, seq))


def titan_gpt_oss(shape: dict[str, Any], seq: int) -> torch.nn.Module:
    """torchtitan's GPT-OSS model from its "20b" arguments at ``shape``'s widths (FlexAttention, sinks)."""
    from torchtitan.models.gpt_oss import GptOssModel, gptoss_configs

    base = gptoss_configs["20b"]
    moe_args = dataclasses.replace(
        base.moe_args, num_experts=shape["num_local_experts"], top_k=shape["num_experts_per_tok"]
    )
    model_args = dataclasses.replace(
        base,
        vocab_size=shape["vocab_size"],
        dim=shape["hidden_size"],
        moe_inter_dim=shape["intermediate_size"],
        n_layers=shape["num_hidden_layers"],
        norm_eps=shape["rms_norm_eps"],
        moe_args=moe_args,
        head_dim=shape["head_dim"],
        n_heads=shape["num_attention_heads"],
        n_kv_heads=shape["num_key_value_heads"],
        sliding_window_size=shape["sliding_window"],
        attn_mask_type="causal",
        max_seq_len=seq,
    )
    with torch.device("meta"):
        return GptOssModel(_as_trainer_sets(model_args, seq))


def titan_model(shape: dict[str, Any], seq: int) -> torch.nn.Module:
    """torchtitan's model of ``shape``'s family on the meta device.

    Raises:
        PeerNotInstalledError: Without torchtitan.
        ValueError: For a family torchtitan 0.2.2 does not ship (Gemma 3, Mistral: compare with
            ``hf_compile``).
    """
    require_torchtitan()
    match shape["model_type"]:
        case "llama":
            return titan_llama3(shape, seq)
        case "qwen3" | "qwen3_moe":
            return titan_qwen3(shape, seq)
        case "deepseek_v3":
            return titan_deepseek_v3(shape, seq)
        case "gpt_oss":
            return titan_gpt_oss(shape, seq)
        case other:
            raise ValueError(
                f"torchtitan {TORCHTITAN_VERSION} has no model for model_type {other}; "
                "compare it with --only hf hf_compile d9d d9d_compile"
            )


def compile_titan_blocks(model: torch.nn.Module, model_type: str) -> None:
    """Compiles ``model``'s blocks as torchtitan 0.2.2's trainer does for the family.

    GPT-OSS: no block is compiled (its ``parallelize_gptoss`` has no compile step; FlexAttention
    compiles itself). DeepSeek-V3 (llama4's ``apply_compile``): dense blocks whole; in an MoE
    block each child, and each child of the MoE but its experts (grouped GEMMs stay eager).
    Llama 3 and Qwen3: each block whole, as this benchmark's earlier rows.
    """
    layers: Any = model.layers
    match model_type:
        case "gpt_oss":
            return
        case "deepseek_v3":
            torch._dynamo.config.capture_scalar_outputs = True  # as its apply_compile sets
            for name, block in list(layers.named_children()):
                if not block.moe_enabled:
                    layers.register_module(name, torch.compile(block, fullgraph=True))
                    continue
                _compile_moe_block(block)
        case _:
            for name, block in list(layers.named_children()):
                layers.register_module(name, torch.compile(block, fullgraph=True))


def _compile_moe_block(block: torch.nn.Module) -> None:
    """Each child of ``block`` and of its ``moe`` compiled, the experts eager (llama4's apply_compile)."""
    for name, child in list(block.named_children()):
        if name != "moe":
            block.register_module(name, torch.compile(child, fullgraph=True))
            continue
        for part_name, part in list(child.named_children()):
            if part_name != "experts":
                child.register_module(part_name, torch.compile(part, fullgraph=True))


def titan_logits(model: Any, inputs: torch.Tensor, model_type: str) -> torch.Tensor:
    """The model's logits; GPT-OSS takes its block masks, built each step as its trainer does."""
    if model_type == "gpt_oss":
        return model(inputs, attention_masks=model.get_attention_masks(inputs, tokenizer=None))
    return model(inputs)
