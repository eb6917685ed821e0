"""Qwen3 and Qwen3-MoE config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, TypeAdapter, model_validator

from d9d.hf._decoder import (
    DecoderConfigBase,
    DecoderLayer,
    DecoderSpec,
    DecoderTensorParallelPlan,
    LayerRecipe,
    LayerTensor,
    LayerType,
    MegatronDecoderPlan,
    build_layer,
    layer_windows,
    read_config_file,
    resolve_layer_types,
)
from d9d.hf._head import HeadName
from d9d.hf.qwen3._feed_forward import qwen3_feed_forward
from d9d.hf.qwen3._layer_tensors import qwen3_layer_tensors
from d9d.hf.qwen3._spec import Qwen3MoeSpec, Qwen3Spec
from d9d.kernels.layers import AttentionBackend, AttentionBackendName


class _Qwen3CommonConfig(DecoderConfigBase):
    """Fields shared by Qwen3 and Qwen3-MoE, and the ``DecoderFamily`` methods both implement."""

    vocab_size: int = 151936
    num_attention_heads: int = 32
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096

    @property
    def effective_sliding_window(self) -> int | None:
        """The window of sliding layers: ``sliding_window`` only when ``use_sliding_window``."""
        return self.sliding_window if self.use_sliding_window else None

    def qwen3_spec(self) -> Qwen3Spec:
        """The Qwen3 description of this config (``qwen3_spec``)."""
        match self:
            case Qwen3DenseConfig() | Qwen3MoeConfig():
                return qwen3_spec(self)
            case _:
                raise TypeError(f"{type(self).__name__} is neither Qwen3DenseConfig nor Qwen3MoeConfig")

    def decoder_spec(self) -> DecoderSpec:
        """The core's numbers: the Qwen3 description (a ``DecoderSpec``)."""
        return self.qwen3_spec()

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | None:
        """Qwen3's layers: Megatron's layout with the per-head q/k norms (``MegatronDecoderPlan``).

        Qwen3-MoE's sparse layers are refused under tensor parallelism: use expert parallelism.
        """
        return MegatronDecoderPlan()

    def layer_recipe(self, index: int) -> LayerRecipe:
        """Qwen3's layer: per-head q/k norms, biases on q/k/v/o with ``attention_bias``, layer
        ``index``'s window."""
        spec = self.qwen3_spec()
        return dataclasses.replace(
            super().layer_recipe(index),
            head_dim=spec.head_dim,
            qkv_bias=spec.attention_bias,
            o_bias=spec.attention_bias,
            qk_norm="head",
            sliding_window=spec.sliding_windows[index],
        )

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        """Layer ``index`` of ``layer_recipe``, its feed-forward dense or the experts by ``index``."""
        spec = self.qwen3_spec()
        return build_layer(
            self.layer_recipe(index),
            attention_backend=attention_backend,
            feed_forward=lambda: qwen3_feed_forward(spec, index),
        )

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """Qwen3's name table of layer ``index``."""
        return qwen3_layer_tensors(self.qwen3_spec(), index)


class Qwen3DenseConfig(_Qwen3CommonConfig):
    """config.json of ``model_type: qwen3`` (``Qwen3ForCausalLM`` and its heads)."""

    model_type: Literal["qwen3"]
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int = 128
    max_window_layers: int = 28
    layer_types: list[LayerType] | None = None

    architecture_prefix: ClassVar[str] = "Qwen3"

    @model_validator(mode="after")
    def _layer_types_per_layer(self) -> Qwen3DenseConfig:
        self.resolved_layer_types()
        return self

    def resolved_layer_types(self) -> list[LayerType]:
        """Each layer's attention: ``layer_types``, else sliding from ``max_window_layers`` on."""
        return resolve_layer_types(
            self.layer_types,
            window=self.effective_sliding_window,
            max_window_layers=self.max_window_layers,
            num_layers=self.num_hidden_layers,
        )


class Qwen3MoeConfig(_Qwen3CommonConfig):
    """config.json of ``model_type: qwen3_moe`` (``Qwen3MoeForCausalLM`` and its heads).

    ``max_window_layers`` appears in released Qwen3-MoE files but transformers' MoE model ignores
    it (a sliding window, when enabled, applies to every layer); d9d does the same.
    """

    model_type: Literal["qwen3_moe"]
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    max_window_layers: int | None = None
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int | None = None
    num_local_experts: int | None = None
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] | None = None

    architecture_prefix: ClassVar[str] = "Qwen3Moe"

    @property
    def experts(self) -> int:
        """Routed experts (``num_local_experts`` in newer files, ``num_experts`` in older ones)."""
        if self.num_local_experts is not None:
            return self.num_local_experts
        return 128 if self.num_experts is None else self.num_experts

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` is sparse, by ``mlp_only_layers`` and ``decoder_sparse_step``."""
        return (
            index not in (self.mlp_only_layers or [])
            and self.experts > 0
            and (index + 1) % self.decoder_sparse_step == 0
        )


Qwen3Config = Annotated[Qwen3DenseConfig | Qwen3MoeConfig, Field(discriminator="model_type")]
"""A Qwen3 or Qwen3-MoE config.json, told apart by ``model_type``."""

QWEN3_CONFIG_ADAPTER: TypeAdapter[Qwen3DenseConfig | Qwen3MoeConfig] = TypeAdapter(Qwen3Config)


def qwen3_spec(config: Qwen3DenseConfig | Qwen3MoeConfig) -> Qwen3Spec:
    """Resolves a config into the plain description the models are built from."""
    num_kv_heads = config.num_key_value_heads or config.num_attention_heads
    window = config.effective_sliding_window
    match config:
        case Qwen3DenseConfig():
            head_dim = config.head_dim
            windows = layer_windows(
                config.layer_types,
                window=window,
                max_window_layers=config.max_window_layers,
                num_layers=config.num_hidden_layers,
            )
            moe = None
            moe_layers = tuple(False for _ in range(config.num_hidden_layers))
        case Qwen3MoeConfig():
            head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
            windows = tuple(window for _ in range(config.num_hidden_layers))
            moe = Qwen3MoeSpec(
                num_experts=config.experts,
                top_k=config.num_experts_per_tok,
                intermediate_size=config.moe_intermediate_size,
                norm_topk_prob=config.norm_topk_prob,
                router_aux_loss_coef=config.router_aux_loss_coef,
                output_router_logits=config.output_router_logits,
            )
            moe_layers = tuple(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    return Qwen3Spec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.theta,
        rope_scaling=config.rope_scaling_method,
        attention_bias=config.attention_bias,
        sliding_windows=windows,
        tie_word_embeddings=config.tie_word_embeddings,
        moe=moe,
        moe_layers=moe_layers,
        pad_token_id=config.pad_token_id,
        num_labels=config.resolved_num_labels,
        initializer_range=config.initializer_range,
        has_experts=moe is not None,
        num_experts=0 if moe is None else moe.num_experts,
        load_balancing_coefficient=0.0 if moe is None else moe.load_balancing_coefficient,
    )


def read_qwen3_config(directory: Path | str) -> Qwen3DenseConfig | Qwen3MoeConfig:
    """Reads and validates ``directory/config.json`` as a Qwen3 or Qwen3-MoE config.

    Raises:
        ValueError: Naming the file and every offending field: another ``model_type`` or
            ``architectures``, an unknown field, a value d9d does not implement.
    """
    return read_config_file(directory, QWEN3_CONFIG_ADAPTER, what="Qwen3 / Qwen3-MoE")


def hf_architecture(config: Qwen3DenseConfig | Qwen3MoeConfig, head: HeadName) -> str:
    """The transformers class name transformers writes for ``head`` (``config.hf_architecture``)."""
    return config.hf_architecture(head)
