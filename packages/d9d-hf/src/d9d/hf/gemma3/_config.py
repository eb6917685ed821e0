"""Gemma 3 (text only) config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

from pydantic import Field, TypeAdapter, field_validator, model_validator

from d9d.hf._decoder import (
    DecoderConfigBase,
    DecoderSpec,
    DecoderTensorParallelPlan,
    LayerRecipe,
    LayerTensor,
    LayerType,
    MegatronDecoderPlan,
    read_config_file,
)
from d9d.hf.gemma3._layer_tensors import gemma3_layer_tensors

_GLOBAL_ROPE_THETA = 1_000_000.0
_LOCAL_ROPE_THETA = 10_000.0


def _split_layer_rope(data: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` keyed by layer type, as the global block and a local base."""
    found = data.get("rope_parameters")
    if not isinstance(found, dict):
        return data
    blocks = cast(dict[str, Any], found)
    if not ({"full_attention", "sliding_attention"} & blocks.keys()):
        return data
    unknown = sorted(set(blocks) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"rope_parameters has unknown layer types {unknown}")
    local = cast(dict[str, Any], blocks.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default" or set(local) - {"rope_type", "rope_theta"}:
        raise ValueError(
            f"rope_parameters.sliding_attention={local} is not implemented "
            "(d9d's local layers use plain RoPE)"
        )
    split: dict[str, Any] = {**data, "rope_parameters": blocks.get("full_attention")}
    if "rope_theta" in local:
        split["rope_local_base_freq"] = local["rope_theta"]
    return split


class Gemma3TextConfig(DecoderConfigBase):
    """config.json of ``model_type: gemma3_text`` (``Gemma3ForCausalLM`` and its heads; Gemma 3, text only).

    Sliding (local) and global layers alternate, from ``layer_types`` or else every
    ``sliding_window_pattern``-th layer global; local layers use plain RoPE at
    ``rope_local_base_freq``, global layers ``rope_theta`` with the rope block's scaling. Every
    norm scales by ``1 + weight``; the embeddings are multiplied by ``sqrt(hidden_size)`` rounded to
    their dtype; scores are scaled by ``query_pre_attn_scalar ** -0.5``. The rope block is read in
    both spellings (transformers 5's per-layer-type ``rope_parameters`` and the older
    ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``) and written in the first. Logit
    soft-capping and bidirectional attention are refused, naming the field.
    """

    architecture_prefix: ClassVar[str] = "Gemma3"

    model_type: Literal["gemma3_text"]
    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int = 256
    hidden_activation: Literal["gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    query_pre_attn_scalar: int = 256
    sliding_window: int | None = 4096
    layer_types: list[LayerType] | None = None
    sliding_window_pattern: int | None = None
    private_sliding_window_pattern: int | None = Field(default=None, alias="_sliding_window_pattern")
    rope_local_base_freq: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: Literal[False] | None = False
    cache_implementation: str | None = None  # a generation setting of the 1B file ("hybrid"); d9d ignores it

    @model_validator(mode="before")
    @classmethod
    def _layer_rope(cls, data: object) -> object:
        return _split_layer_rope(cast(dict[str, Any], data)) if isinstance(data, dict) else data

    @field_validator("final_logit_softcapping", "attn_logit_softcapping")
    @classmethod
    def _no_softcapping(cls, value: float | None) -> float | None:
        if value is not None:
            raise ValueError(f"soft-capping {value} is not implemented (d9d supports null only)")
        return value

    @model_validator(mode="after")
    def _one_type_per_layer(self) -> Gemma3TextConfig:
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers={self.num_hidden_layers}"
            )
        return self

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim`` (Gemma 3 always writes it)."""
        return self.head_dim

    @property
    def theta(self) -> float:
        """The global layers' rope base: the rope block's, else ``rope_theta``, else 1e6."""
        rope = self.rope
        if rope is not None and rope.rope_theta is not None:
            return rope.rope_theta
        return _GLOBAL_ROPE_THETA if self.rope_theta is None else self.rope_theta

    @property
    def local_theta(self) -> float:
        """The sliding layers' rope base: ``rope_local_base_freq``, else 1e4."""
        return _LOCAL_ROPE_THETA if self.rope_local_base_freq is None else self.rope_local_base_freq

    def resolved_layer_types(self) -> list[LayerType]:
        """Each layer's attention: ``layer_types``, else every ``pattern``-th layer global (default 6)."""
        if self.layer_types is not None:
            return list(self.layer_types)
        pattern = self.sliding_window_pattern or self.private_sliding_window_pattern or 6
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(self.num_hidden_layers)
        ]

    def decoder_spec(self) -> DecoderSpec:
        """The shared numbers, the scaled embedding, the local layers' rope, the ``1 + weight`` final norm."""
        local = {i for i, kind in enumerate(self.resolved_layer_types()) if kind == "sliding_attention"}
        return dataclasses.replace(
            super().decoder_spec(),
            embedding_multiplier=self.hidden_size**0.5,
            round_embedding_multiplier=True,
            alternate_rope_theta=self.local_theta,
            alternate_rope_layers=frozenset(local),
            zero_centered_final_norm=True,
        )

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        """Megatron's layout (``MegatronDecoderPlan``), all four norms on the sequence slice."""
        return MegatronDecoderPlan()

    def layer_recipe(self, index: int) -> LayerRecipe:
        """Gemma 3's layer: four ``1 + weight`` norms around both branches (``norm_layout="sandwich"``),
        per-head q/k norms, scores times ``query_pre_attn_scalar ** -0.5``, the GELU-tanh gated MLP,
        and layer ``index``'s window (``sliding_window`` on a sliding layer, None on a global one)."""
        sliding = self.resolved_layer_types()[index] == "sliding_attention"
        return dataclasses.replace(
            super().layer_recipe(index),
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            qk_norm="head",
            sliding_window=self.sliding_window if sliding else None,
            softmax_scale=self.query_pre_attn_scalar**-0.5,
            activation="gelu_tanh",
            norm_layout="sandwich",
            zero_centered_norms=True,
        )

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """Gemma 3's name table of layer ``index``."""
        del index
        return gemma3_layer_tensors(attention_bias=self.attention_bias)

    def to_json_dict(self) -> dict[str, Any]:
        """The config.json, its rope written per layer type (transformers 5's ``rope_parameters``)."""
        data = super().to_json_dict()
        for legacy in ("rope_theta", "rope_scaling", "rope_local_base_freq", "hidden_act"):
            data.pop(legacy, None)
        rope = self.rope
        full: dict[str, Any] = (
            {"rope_type": "default"} if rope is None else rope.model_dump(exclude_none=True)
        )
        data["rope_parameters"] = {
            "full_attention": {**full, "rope_theta": self.theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": self.local_theta},
        }
        return data


GEMMA3_TEXT_CONFIG_ADAPTER: TypeAdapter[Gemma3TextConfig] = TypeAdapter(Gemma3TextConfig)


def read_gemma3_text_config(directory: Path | str) -> Gemma3TextConfig:
    """Reads and validates ``directory/config.json`` as a Gemma 3 text config.

    Raises:
        ValueError: Naming the file and every offending field.
    """
    return read_config_file(directory, GEMMA3_TEXT_CONFIG_ADAPTER, what="Gemma 3 text")
