"""DeepSeek-V3 config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, TypeAdapter, field_validator, model_validator

from d9d.hf._decoder import (
    DecoderConfigBase,
    DecoderLayer,
    DecoderTensorParallelPlan,
    LatentAttentionDecoderPlan,
    LayerTensor,
    TensorParallelRefusal,
    read_config_file,
)
from d9d.hf.deepseek_v3._decoder_layer import DeepseekV3DecoderLayer
from d9d.hf.deepseek_v3._layer_tensors import deepseek_v3_layer_tensors
from d9d.hf.deepseek_v3._spec import DeepseekV3LatentSpec, DeepseekV3MoeSpec, DeepseekV3Spec
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, latent_attention_softmax_scale


def _refuse_router_logits(enabled: bool) -> bool:
    if enabled:
        raise ValueError(
            "output_router_logits=true: transformers' DeepSeek-V3 computes no auxiliary loss "
            "(its routers balance by e_score_correction_bias); use model.expert_bias_update_rate"
        )
    return enabled


class DeepseekV3Config(DecoderConfigBase):
    """config.json of ``model_type: deepseek_v3`` (``DeepseekV3ForCausalLM`` and its heads).

    transformers' DeepSeek-V3 computes no auxiliary (load-balancing) loss: its routers balance by
    the selection bias alone, so ``output_router_logits: true`` is refused (use
    ``model.expert_bias_update_rate`` to move the biases while training). ``aux_loss_alpha`` and
    ``seq_aux`` of the released files are read and ignored, as transformers does.
    ``num_nextn_predict_layers`` (multi-token prediction) is read; its weights in a checkpoint
    are refused naming the tensor (d9d does not implement those modules). ``num_key_value_heads``
    is read and unused: MLA's keys and values are per head.
    """

    architecture_prefix: ClassVar[str] = "DeepseekV3"

    model_type: Literal["deepseek_v3"]
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    n_shared_experts: int = Field(default=1, ge=1)
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = Field(default=3, ge=0)
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pretraining_tp: int | None = 1
    rope_interleave: bool = True
    attention_bias: bool = False
    output_router_logits: bool = False
    num_nextn_predict_layers: int = 1
    head_dim: int | None = None
    qk_head_dim: int | None = None
    scoring_func: Literal["sigmoid"] = "sigmoid"
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    moe_layer_freq: Literal[1] = 1
    ep_size: int = 1
    aux_loss_alpha: float | None = None
    seq_aux: bool | None = None

    @field_validator("output_router_logits")
    @classmethod
    def _no_auxiliary_loss(cls, value: bool) -> bool:
        return _refuse_router_logits(value)

    @model_validator(mode="after")
    def _derived_widths_agree(self) -> Self:
        # transformers writes head_dim (= qk_rope_head_dim) and qk_head_dim (= nope + rope)
        rope, nope = self.qk_rope_head_dim, self.qk_nope_head_dim
        if self.head_dim is not None and self.head_dim != rope:
            raise ValueError(f"head_dim={self.head_dim} must equal qk_rope_head_dim={rope}")
        if self.qk_head_dim is not None and self.qk_head_dim != nope + rope:
            raise ValueError(
                f"qk_head_dim={self.qk_head_dim} must equal "
                f"qk_nope_head_dim + qk_rope_head_dim = {nope + rope}"
            )
        return self

    def to_json_dict(self) -> dict[str, Any]:
        """The config.json content, ``q_lora_rank: null`` kept (its absence reads as the default 1536)."""
        return {**super().to_json_dict(), "q_lora_rank": self.q_lora_rank}

    def with_output_router_logits(self, enabled: bool) -> Self:
        """Refused when ``enabled``: transformers' DeepSeek-V3 has no load-balancing loss.

        Raises:
            ValueError: If ``enabled``.
        """
        _refuse_router_logits(enabled)
        return self

    def decoder_spec(self) -> DeepseekV3Spec:
        """The core's numbers (rotary width ``qk_rope_head_dim``, padded cache width) and DeepSeek-V3's."""
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        scaling = self.rope_scaling_method
        latent = DeepseekV3LatentSpec(
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            softmax_scale=latent_attention_softmax_scale(qk_head_dim, scaling),
            attention_bias=self.attention_bias,
        )
        moe = DeepseekV3MoeSpec(
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            shared_intermediate_size=self.moe_intermediate_size * self.n_shared_experts,
            num_groups=self.n_group,
            top_groups=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            first_k_dense_replace=self.first_k_dense_replace,
        )
        return DeepseekV3Spec(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_attention_heads,
            head_dim=max(qk_head_dim, self.v_head_dim),
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.theta,
            rope_scaling=scaling,
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=self.pad_token_id,
            num_labels=self.resolved_num_labels,
            initializer_range=self.initializer_range,
            has_experts=self.first_k_dense_replace < self.num_hidden_layers,
            num_experts=self.n_routed_experts,
            rotary_dim=self.qk_rope_head_dim,
            rope_layout="interleaved" if self.rope_interleave else "half",
            checkpoint_expert_bias=True,
            intermediate_size=self.intermediate_size,
            latent=latent,
            moe=moe,
        )

    def tensor_parallel_plan(self) -> DecoderTensorParallelPlan | TensorParallelRefusal | None:
        """MLA split by heads (``LatentAttentionDecoderPlan``) when every layer is dense; else a refusal.

        The MoE layers take expert parallelism (``mesh.expert_parallel``), not tensor parallelism,
        so a model with any sparse layer (``first_k_dense_replace < num_hidden_layers``) is refused.
        """
        if self.first_k_dense_replace < self.num_hidden_layers:
            return TensorParallelRefusal(
                reason=(
                    f"its MoE layers ({self.first_k_dense_replace} to {self.num_hidden_layers - 1}: "
                    f"first_k_dense_replace={self.first_k_dense_replace} < num_hidden_layers="
                    f"{self.num_hidden_layers}) split by expert parallelism (mesh.expert_parallel), not "
                    f"tensor parallelism; only its attention (MLA) and dense layers have a tp plan"
                )
            )
        return LatentAttentionDecoderPlan()

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        """A ``DeepseekV3DecoderLayer``: MLA, a dense or sparse feed-forward by ``index``."""
        return DeepseekV3DecoderLayer(self.decoder_spec(), index, attention_backend=attention_backend)

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        """DeepSeek-V3's name table of layer ``index``."""
        return deepseek_v3_layer_tensors(self.decoder_spec(), index)


DEEPSEEK_V3_CONFIG_ADAPTER: TypeAdapter[DeepseekV3Config] = TypeAdapter(DeepseekV3Config)


def read_deepseek_v3_config(directory: Path | str) -> DeepseekV3Config:
    """Reads and validates ``directory/config.json`` as a DeepSeek-V3 config.

    Raises:
        ValueError: Naming the file and every offending field: another ``model_type``, an unknown
            field (``quantization_config``: FP8 checkpoints are not read), a value d9d does not
            implement.
    """
    return read_config_file(directory, DEEPSEEK_V3_CONFIG_ADAPTER, what="DeepSeek-V3")
