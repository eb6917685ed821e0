"""GPT-OSS config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, cast

from pydantic import TypeAdapter, field_validator, model_validator

from d9d.hf._decoder import (
    DecoderConfigBase,
    DecoderLayer,
    DecoderSpec,
    LayerTensor,
    LayerType,
    TensorParallelRefusal,
    read_config_file,
)
from d9d.hf.gpt_oss._decoder_layer import GptOssDecoderLayer, GptOssLayerSpec
from d9d.hf.gpt_oss._layer_tensors import gpt_oss_layer_tensors
from d9d.kernels.layers import AttentionBackend, AttentionBackendName

_DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}
"""transformers' rope block for a GPT-OSS config.json that has none."""

_LOG = logging.getLogger(__name__)


class GptOssConfig(DecoderConfigBase):
    """config.json of ``model_type: gpt_oss`` (``GptOssForCausalLM`` and its heads).

    Every layer is a mixture of experts; sliding-window and full-attention layers alternate by
    ``layer_types`` (by default even layers slide); every attention head has a learned sink.
    An MXFP4-quantized checkpoint (``quantization_config.quant_method: mxfp4``, experts stored as
    ``*_blocks`` / ``*_scales``) is dequantized to bf16 while it loads; other quantizations are
    refused. Exported configs leave ``quantization_config`` out: d9d writes bf16 tensors.
    """

    architecture_prefix: ClassVar[str] = "GptOss"

    model_type: Literal["gpt_oss"]
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    head_dim: int = 64
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = 128
    layer_types: list[LayerType] | None = None
    attention_bias: bool = True
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    experts_per_token: int | None = None  # OpenAI's original files repeat num_experts_per_tok
    initial_context_length: int | None = None  # OpenAI's original files: the rope block's context
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    quantization_config: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_rope(cls, data: object) -> object:
        """transformers' yarn block (at ``rope_theta``, else 150000) where the file has none."""
        if not isinstance(data, dict):
            return data
        fields = cast(dict[str, Any], data)
        if fields.get("rope_parameters") is not None or fields.get("rope_scaling") is not None:
            return fields
        theta = fields.get("rope_theta") or _DEFAULT_ROPE["rope_theta"]
        return {**fields, "rope_parameters": {**_DEFAULT_ROPE, "rope_theta": theta}}

    @field_validator("quantization_config")
    @classmethod
    def _mxfp4_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("quant_method") != "mxfp4":
            raise ValueError(
                f"quant_method={value.get('quant_method')!r}: only MXFP4-quantized GPT-OSS checkpoints "
                "(quant_method 'mxfp4', dequantized to bf16 at load) are supported; load a bf16 "
                "checkpoint instead"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.experts_per_token is not None and self.experts_per_token != self.num_experts_per_tok:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} differs from "
                f"num_experts_per_tok={self.num_experts_per_tok}"
            )
        types = self.resolved_layer_types()
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
        if self.quantization_config is not None:
            _LOG.info(
                "GPT-OSS checkpoint is MXFP4-quantized: its experts are dequantized to bf16 at load, "
                "%.2f GiB of expert weights in memory (about 3.8x their MXFP4 size)",
                self.expert_weight_bytes(2) / 2**30,
            )
        return self

    def expert_weight_bytes(self, bytes_per_value: int) -> int:
        """Bytes of every layer's expert matrices (``gate_up_proj`` and ``down_proj``, no biases)."""
        per_expert = 3 * self.hidden_size * self.intermediate_size
        return self.num_hidden_layers * self.num_local_experts * per_expert * bytes_per_value

    def to_json_dict(self) -> dict[str, Any]:
        """The config.json content, without ``quantization_config``: d9d loads and writes bf16 experts."""
        content = super().to_json_dict()
        content.pop("quantization_config", None)
        return content

    def resolved_layer_types(self) -> list[LayerType]:
        """Each layer's attention: ``layer_types``, else sliding on even layers, as transformers.

        Raises:
            ValueError: If ``layer_types`` does not have one entry per layer.
        """
        if self.layer_types is None:
            return [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers={self.num_hidden_layers}"
            )
        return list(self.layer_types)

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim`` (GPT-OSS's heads are not ``hidden_size // num_attention_heads`` wide)."""
        return self.head_dim

    @property
    def load_balancing_coefficient(self) -> float:
        """``router_aux_loss_coef`` when ``output_router_logits`` (transformers' objective), else 0."""
        return self.router_aux_loss_coef if self.output_router_logits else 0.0

    def decoder_spec(self) -> DecoderSpec:
        """The core's numbers, with the experts of every layer."""
        return dataclasses.replace(
            super().decoder_spec(),
            has_experts=True,
            num_experts=self.num_local_experts,
            load_balancing_coefficient=self.load_balancing_coefficient,
            attention_sinks=True,
        )

    def layer_spec(self, index: int) -> GptOssLayerSpec:
        """The numbers layer ``index`` is built from (its window by ``layer_types``)."""
        sliding = self.resolved_layer_types()[index] == "sliding_attention"
        return GptOssLayerSpec(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads or self.num_attention_heads,
            head_dim=self.head_dim,
            attention_bias=self.attention_bias,
            sliding_window=self.sliding_window if sliding else None,
            num_experts=self.num_local_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.intermediate_size,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
            load_balancing_coefficient=self.load_balancing_coefficient,
            rms_norm_eps=self.rms_norm_eps,
            init_std=self.initializer_range,
        )

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        """A ``GptOssDecoderLayer``: sinks, biases, the window of layer ``index``, experts."""
        return GptOssDecoderLayer(self.layer_spec(index), attention_backend=attention_backend)

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """GPT-OSS's name table of layer ``index``."""
        del index
        return gpt_oss_layer_tensors(
            attention_bias=self.attention_bias,
            num_experts=self.num_local_experts,
            hidden_size=self.hidden_size,
        )

    def tensor_parallel_plan(self) -> TensorParallelRefusal:
        """Refused: every GPT-OSS layer is a mixture of experts, which tensor parallelism does not split."""
        return TensorParallelRefusal(
            reason=(
                "every layer's feed-forward is a mixture of experts, which d9d's tensor parallelism does "
                "not split; use expert_parallel (with data_parallel_shard) instead"
            )
        )


GPT_OSS_CONFIG_ADAPTER: TypeAdapter[GptOssConfig] = TypeAdapter(GptOssConfig)


def read_gpt_oss_config(directory: Path | str) -> GptOssConfig:
    """Reads and validates ``directory/config.json`` as a GPT-OSS config.

    Raises:
        ValueError: Naming the file and every offending field (a quantized checkpoint among them).
    """
    return read_config_file(directory, GPT_OSS_CONFIG_ADAPTER, what="GPT-OSS")
