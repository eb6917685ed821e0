"""Phi-3 config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

from pydantic import TypeAdapter, field_validator

from d9d.hf._decoder import (
    DecoderConfigWithHeadDim,
    DecoderSpec,
    DecoderTensorParallelPlan,
    LayerRecipe,
    LayerTensor,
    MegatronDecoderPlan,
    read_config_file,
)
from d9d.hf.phi3._layer_tensors import phi3_layer_tensors

_LEGACY_LONGROPE_NAMES = ("su", "yarn")  # what older Phi-3 files call LongRoPE


class Phi3Config(DecoderConfigWithHeadDim):
    """config.json of ``model_type: phi3`` (``Phi3ForCausalLM`` and its heads).

    Phi-3-mini-4k, Phi-3-medium-4k and Phi-4 files (plain RoPE), the 128k-context ones
    (Phi-3-mini-128k, Phi-3-medium-128k, Phi-3.5-mini: LongRoPE, ``rope_scaling.type``
    ``longrope``, or ``su``/``yarn`` in older files) and Phi-4-mini (LongRoPE over the leading
    ``partial_rotary_factor`` of each head, 0.75, the rest passed through), a ``sliding_window``
    on every layer when set. Dropout (``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``) is
    refused, naming the field.
    """

    architecture_prefix: ClassVar[str] = "Phi3"
    rotates_part_of_a_head: ClassVar[bool] = True

    model_type: Literal["phi3"]
    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 32000
    pad_token_id: int | None = 32000
    sliding_window: int | None = None
    resid_pdrop: float = 0.0
    embd_pdrop: float = 0.0
    partial_rotary_factor: float | None = None
    # in the Hub files, read and ignored as transformers' Phi-3 ignores them (its layers and head
    # have no biases; Phi-4-mini's two remote-code fields do nothing there)
    attention_bias: bool = False
    mlp_bias: bool = False
    lm_head_bias: bool = False
    full_attn_mod: int | None = None
    interpolate_factor: float | None = None

    @field_validator("rope_parameters", "rope_scaling", mode="before")
    @classmethod
    def _longrope_by_its_legacy_names(cls, value: object) -> object:
        if not isinstance(value, dict):
            return value
        fields = cast(dict[str, Any], value)
        if fields.get("rope_type", fields.get("type")) in _LEGACY_LONGROPE_NAMES:
            return {**fields, "rope_type": "longrope"}
        return fields

    @property
    def rotary_fraction(self) -> float:
        """The rope block's ``partial_rotary_factor``, else the top-level one (Phi-4-mini: 0.75), else 1."""
        rope = self.rope
        if rope is not None and rope.partial_rotary_factor is not None:
            return rope.partial_rotary_factor
        return 1.0 if self.partial_rotary_factor is None else self.partial_rotary_factor

    def decoder_spec(self) -> DecoderSpec:
        """The shared numbers, with the rotary tables ``rotary_fraction`` of a head wide."""
        spec = super().decoder_spec()
        if self.resolved_rotary_dim == spec.head_dim:
            return spec
        return dataclasses.replace(spec, rotary_dim=self.resolved_rotary_dim)

    @property
    def original_context(self) -> int:
        """``original_max_position_embeddings``: LongRoPE's pretrained context."""
        return self.original_max_position_embeddings

    @field_validator("resid_pdrop", "embd_pdrop")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError(f"dropout {value} is not implemented (d9d's Phi-3 layer has no dropout)")
        return value

    def layer_recipe(self, index: int) -> LayerRecipe:
        """Phi-3's layer: Llama's parts held apart (the checkpoint's fused ones are split on load),
        ``sliding_window`` (when set) on every layer."""
        return dataclasses.replace(super().layer_recipe(index), sliding_window=self.sliding_window)

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        """Megatron's plan: d9d holds q/k/v and gate/up apart (the checkpoint's fusion is split on load)."""
        return MegatronDecoderPlan()

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """Phi-3's name table of layer ``index``: fused qkv and gate/up in the checkpoint."""
        del index
        head_dim = self.resolved_head_dim
        return phi3_layer_tensors(
            hidden_q=self.num_attention_heads * head_dim,
            hidden_kv=(self.num_key_value_heads or self.num_attention_heads) * head_dim,
            intermediate_size=self.intermediate_size,
        )


PHI3_CONFIG_ADAPTER: TypeAdapter[Phi3Config] = TypeAdapter(Phi3Config)


def read_phi3_config(directory: Path | str) -> Phi3Config:
    """Reads and validates ``directory/config.json`` as a Phi-3 config.

    Raises:
        ValueError: Naming the file and every offending field.
    """
    return read_config_file(directory, PHI3_CONFIG_ADAPTER, what="Phi-3")
