"""The config.json fields every decoder family shares, and what the core derives from them."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from d9d.hf._decoder._decoder_layer import DecoderLayer
from d9d.hf._decoder._layer_builder import build_layer
from d9d.hf._decoder._layer_recipe import LayerRecipe
from d9d.hf._decoder._spec import DecoderSpec
from d9d.hf._head import HeadName
from d9d.hf._rope_parameters import LongRopeParameters, RopeParameters, rope_scaling_of, with_rope_type
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, RopeScaling

ProblemType = Literal["regression", "single_label_classification", "multi_label_classification"]


class DecoderConfigBase(BaseModel):
    """Fields of every transformers decoder config.json (pydantic, ``extra="forbid"``).

    A family subclasses it with its ``model_type`` literal, its own fields and defaults (a
    field redeclared with the family's default), and ``architecture_prefix`` (``"Llama"`` gives
    ``LlamaForCausalLM``, ``LlamaModel``, ...). ``decoder_spec`` reads the shared fields; a family
    whose numbers differ (a ``head_dim`` rule, experts) overrides it. ``layer_recipe`` describes
    a layer from the shared fields, and a family sets the switches its layers differ by there;
    ``build_decoder_layer`` builds that recipe. A field is redeclared only where the family's
    default differs from the one here.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    architecture_prefix: ClassVar[str] = ""
    rotates_part_of_a_head: ClassVar[bool] = False
    """The family's transformers code honours a ``partial_rotary_factor`` below 1 (Phi-3's does)."""

    architectures: list[str] | None = None
    # the Hub file's pointers to custom code: d9d builds the family's own model and exports for
    # transformers' own class, so they are read and left out of an export
    auto_map: dict[str, Any] | None = Field(default=None, exclude=True)
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
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: Literal["silu"] = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | None = None
    rope_theta: float | None = None
    rope_scaling: RopeParameters | None = None
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

    @model_validator(mode="after")
    def _pad_token_in_vocabulary(self) -> Self:
        # Phi-3's default (32000) with a smaller vocabulary would otherwise fail deep inside
        # nn.Embedding with "Padding_idx must be within num_embeddings".
        if self.pad_token_id is not None and self.pad_token_id >= self.vocab_size:
            raise ValueError(
                f"pad_token_id={self.pad_token_id} is outside the vocabulary (vocab_size={self.vocab_size}): "
                "set pad_token_id to a token id below vocab_size, or null"
            )
        return self

    @model_validator(mode="after")
    def _whole_head_rotated(self) -> Self:
        factor = self.rotary_fraction
        if factor != 1.0 and not self.rotates_part_of_a_head:
            raise ValueError(
                f"partial_rotary_factor={factor} is not implemented for model_type "
                f"{type(self).__name__} (its layers rotate every channel of a head)"
            )
        if self.resolved_rotary_dim <= 0 or self.resolved_rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={factor} of head_dim {self.resolved_head_dim} rotates "
                f"{self.resolved_rotary_dim} channels; it must be a positive even number"
            )
        return self

    @model_validator(mode="after")
    def _longrope_factors_fit_the_heads(self) -> Self:
        planes = self.resolved_rotary_dim // 2
        for field_name, rope in (
            ("rope_parameters", self.rope_parameters),
            ("rope_scaling", self.rope_scaling),
        ):
            if not isinstance(rope, LongRopeParameters):
                continue
            for name, factors in (("short_factor", rope.short_factor), ("long_factor", rope.long_factor)):
                if len(factors) != planes:
                    raise ValueError(
                        f"{field_name}.{name} has {len(factors)} values; a rotary dim of "
                        f"{self.resolved_rotary_dim} needs one per rotation plane, {planes}"
                    )
        return self

    @model_validator(mode="after")
    def _known_architecture(self) -> Self:
        allowed = [
            self.hf_architecture(head) for head in ("causal_lm", "sequence_classification", "embedding")
        ]
        for name in self.architectures or []:
            if name not in allowed:
                raise ValueError(f"architectures={self.architectures}: {name!r} is not one of {allowed}")
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
    def rope_scaling_method(self) -> RopeScaling | None:
        """d9d-kernels' scaling for the rope block (None for plain RoPE); its original context
        defaults to ``original_context``, else ``max_position_embeddings``, as in Hugging Face."""
        return rope_scaling_of(
            self.rope,
            max_position_embeddings=self.max_position_embeddings,
            original_max_position_embeddings=self.original_context,
        )

    @property
    def rotary_fraction(self) -> float:
        """The rotated fraction of a head: the rope block's ``partial_rotary_factor``, else 1."""
        rope = self.rope
        if rope is None or rope.partial_rotary_factor is None:
            return 1.0
        return rope.partial_rotary_factor

    @property
    def resolved_rotary_dim(self) -> int:
        """Channels of a head that RoPE rotates: ``head_dim * partial_rotary_factor``."""
        return int(self.resolved_head_dim * self.rotary_fraction)

    @property
    def original_context(self) -> int | None:
        """A top-level ``original_max_position_embeddings`` of the family's files (None here)."""
        return None

    @property
    def resolved_num_labels(self) -> int:
        """Classes of a sequence-classification head: ``num_labels``, else ``id2label``'s, else 2."""
        return self.num_labels or (len(self.id2label) if self.id2label else 2)

    @property
    def resolved_head_dim(self) -> int:
        """The per-head size: ``hidden_size // num_attention_heads`` unless a family says otherwise."""
        return self.hidden_size // self.num_attention_heads

    def decoder_spec(self) -> DecoderSpec:
        """The core's numbers from the shared fields (a dense model: no experts)."""
        return DecoderSpec(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads or self.num_attention_heads,
            head_dim=self.resolved_head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.theta,
            rope_scaling=self.rope_scaling_method,
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=self.pad_token_id,
            num_labels=self.resolved_num_labels,
            initializer_range=self.initializer_range,
        )

    def layer_recipe(self, index: int) -> LayerRecipe:
        """Layer ``index``'s widths from the shared fields, with the plain layer's switches.

        That is a pre-norm layer with no biases, no q/k norms, full attention and a SiLU-gated
        MLP; a family returns ``dataclasses.replace(super().layer_recipe(index), ...)`` with its
        own switches (biases, a window, q/k norms, the norm layout, score and residual scales).
        """
        del index
        return LayerRecipe(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads or self.num_attention_heads,
            head_dim=self.resolved_head_dim,
            intermediate_size=self.intermediate_size,
            norm_eps=self.rms_norm_eps,
            init_std=self.initializer_range,
        )

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        """Decoder layer ``index``, built by the core from ``layer_recipe(index)``."""
        return build_layer(self.layer_recipe(index), attention_backend=attention_backend)

    def hf_architecture(self, head: HeadName) -> str:
        """The transformers class name for ``head`` (``{prefix}ForCausalLM`` and its siblings)."""
        match head:
            case "causal_lm":
                return f"{self.architecture_prefix}ForCausalLM"
            case "sequence_classification":
                return f"{self.architecture_prefix}ForSequenceClassification"
            case "embedding":
                return f"{self.architecture_prefix}Model"

    def to_json_dict(self) -> dict[str, Any]:
        """The config.json content (unset optional fields left out; transformers fills its defaults)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def with_num_labels(self, num_labels: int) -> Self:
        """A copy whose sequence-classification head has ``num_labels`` classes."""
        return self.model_copy(update={"num_labels": num_labels})

    def with_pad_token_id(self, pad_token_id: int) -> Self:
        """A copy whose ``pad_token_id`` is ``pad_token_id`` (checked against the vocabulary).

        Raises:
            ValueError: If it is outside the vocabulary.
        """
        return self.model_validate({**self.model_dump(by_alias=True), "pad_token_id": pad_token_id})

    def with_output_router_logits(self, enabled: bool) -> Self:
        """A copy whose training objective has (or lacks) the MoE load-balancing loss.

        Raises:
            ValueError: If this family's config.json has no ``output_router_logits`` (no router).
        """
        if "output_router_logits" not in type(self).model_fields:
            raise ValueError(
                f"model.load_balancing_loss applies to models with MoE layers; "
                f"{type(self).__name__} has no router"
            )
        return self.model_copy(update={"output_router_logits": enabled})
