"""Qwen3 and Qwen3-MoE config.json, read and written (pydantic, the Hugging Face field names)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from d9d.hf._rope_parameters import RopeParameters, rope_scaling_of, with_rope_type
from d9d.hf.qwen3._spec import Qwen3MoeSpec, Qwen3Spec

LayerType = Literal["full_attention", "sliding_attention"]
ProblemType = Literal["regression", "single_label_classification", "multi_label_classification"]


class _Qwen3CommonConfig(BaseModel):
    """Fields shared by Qwen3 and Qwen3-MoE (and by every transformers config)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    architectures: list[str] | None = None
    transformers_version: str | None = None
    name_or_path: str | None = Field(default=None, alias="_name_or_path")
    dtype: str | None = None
    torch_dtype: str | None = None
    output_hidden_states: bool | None = None
    output_attentions: bool | None = None
    return_dict: bool | None = None
    chunk_size_feed_forward: int | None = None
    is_encoder_decoder: Literal[False] | None = None
    id2label: dict[str, str] | None = None
    label2id: dict[str, int] | None = None
    num_labels: int | None = None
    problem_type: ProblemType | None = None
    vocab_size: int = 151936
    num_attention_heads: int = 32
    hidden_act: Literal["silu"] = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | None = None
    rope_theta: float | None = None
    rope_scaling: RopeParameters | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    attention_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @field_validator("rope_parameters", "rope_scaling", mode="before")
    @classmethod
    def _rope_type(cls, value: object) -> object:
        return with_rope_type(value)

    @field_validator("attention_dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError(f"attention_dropout={value} is not implemented (d9d attention has no dropout)")
        return value

    def _architecture_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    @model_validator(mode="after")
    def _known_architecture(self) -> _Qwen3CommonConfig:
        allowed = self._architecture_names()
        for name in self.architectures or []:
            if name not in allowed:
                raise ValueError(
                    f"architectures={self.architectures}: {name!r} is not one of {list(allowed)}"
                )
        return self

    @property
    def rope(self) -> RopeParameters | None:
        """The rope block, wherever the file put it (``rope_parameters`` or legacy ``rope_scaling``)."""
        return self.rope_parameters if self.rope_parameters is not None else self.rope_scaling

    @property
    def theta(self) -> float:
        """The rope base: from the rope block, else legacy ``rope_theta``, else 10000."""
        rope = self.rope
        if rope is not None and rope.rope_theta is not None:
            return rope.rope_theta
        return 10000.0 if self.rope_theta is None else self.rope_theta

    @property
    def effective_sliding_window(self) -> int | None:
        """The window of sliding layers: ``sliding_window`` only when ``use_sliding_window``."""
        return self.sliding_window if self.use_sliding_window else None

    def to_json_dict(self) -> dict[str, Any]:
        """The config.json content (unset optional fields left out; transformers fills its defaults)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


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

    def _architecture_names(self) -> tuple[str, ...]:
        return ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "Qwen3Model")

    @model_validator(mode="after")
    def _layer_types_per_layer(self) -> Qwen3DenseConfig:
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers={self.num_hidden_layers}"
            )
        return self

    def resolved_layer_types(self) -> list[LayerType]:
        """Each layer's attention: ``layer_types``, else sliding from ``max_window_layers`` on."""
        if self.layer_types is not None:
            return list(self.layer_types)
        window = self.effective_sliding_window
        return [
            "sliding_attention" if window is not None and i >= self.max_window_layers else "full_attention"
            for i in range(self.num_hidden_layers)
        ]


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

    def _architecture_names(self) -> tuple[str, ...]:
        return ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification", "Qwen3MoeModel")

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
            windows = tuple(
                window if t == "sliding_attention" else None for t in config.resolved_layer_types()
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
        rope_scaling=rope_scaling_of(config.rope, max_position_embeddings=config.max_position_embeddings),
        attention_bias=config.attention_bias,
        sliding_windows=windows,
        tie_word_embeddings=config.tie_word_embeddings,
        moe=moe,
        moe_layers=moe_layers,
        pad_token_id=config.pad_token_id,
        num_labels=config.num_labels or (len(config.id2label) if config.id2label else 2),
        initializer_range=config.initializer_range,
    )
