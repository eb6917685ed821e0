"""The ``model:`` section of a job: start from a Hugging Face checkpoint, or pre-train from scratch."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from d9d.hf._decoder import DecoderHead, FsdpSettings, check_head_specs, head_named
from d9d.hf._families import DecoderConfig
from d9d.hf._head import HeadName
from d9d.hf._head_config import HeadConfig, head_specs
from d9d.kernels.layers import AttentionBackendName
from d9d.parallel import DEFAULT_FLOAT8_EXCLUDE, Float8Recipe, Float8Training

ParamDtype = Literal["float32", "bfloat16", "float16"]
"""Dtype of the gathered parameters in forward/backward (FSDP mixed precision); gradients are
reduced and the optimizer steps in float32."""
MasterDtype = Literal["float32", "bfloat16"]
"""Dtype the parameters are stored, checkpointed and stepped in (their gradients too)."""


ExpertWeightCasts = Literal["per_microbatch", "per_step"]
"""When FP8 experts cast their weights: in every forward and backward, or once per optimizer step."""


class Float8Config(BaseModel):
    """``model: {float8: {recipe: tensorwise}}``: FP8 training of linear layers through torchao.

    Needs the ``float8`` extra (``pip install 'd9d-hf[float8]'``) and, for speed, an H100/H200
    or newer GPU. The weights stay in their own dtype (the master weights); only the matmuls run
    in float8, so checkpoints and exports are unchanged.

    Attributes:
        recipe: ``tensorwise`` (one scale per tensor, fastest) or ``rowwise`` (one per row).
        fsdp_float8_all_gather: FSDP gathers the converted weights in float8 (tensorwise only);
            their scales are precomputed after each optimizer step.
        exclude: Regular expressions searched in each linear layer's name; matches stay in bf16
            (by default the LM head and MoE routers).
        min_features: Layers whose smaller dim is below this stay in bf16; dims that are not
            multiples of 16 always do.
        experts: Also run the MoE experts' grouped GEMMs in FP8 (rowwise scales, whatever
            ``recipe`` says; the router and token permute stay as they are). Needs
            ``param_dtype: bfloat16`` and a GPU of compute capability 9.0 or newer.
        expert_weight_casts: When the experts' weights are cast to float8: ``per_microbatch``
            (in every forward and backward) or ``per_step`` (once after each optimizer step,
            kept across the step's microbatches: less time with gradient accumulation or
            pipeline microbatches, one float8 copy of the expert weights in each of two layouts
            held through the step). ``per_step`` needs ``experts: true``; its casts are reused
            only where the experts get the same weight tensors in every microbatch (bf16
            parameters, or FSDP's gathered ones), not float32 ones cast per forward on one rank.
        emulate: Emulate the FP8 matmuls in high precision (tests on machines without FP8).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: Float8Recipe = "tensorwise"
    fsdp_float8_all_gather: bool = False
    exclude: tuple[str, ...] = DEFAULT_FLOAT8_EXCLUDE
    min_features: int = Field(default=128, ge=0)
    experts: bool = False
    expert_weight_casts: ExpertWeightCasts = "per_microbatch"
    emulate: bool = False

    @model_validator(mode="after")
    def _supported(self) -> Float8Config:
        if importlib.util.find_spec("torchao") is None:
            raise ValueError(
                "model.float8 needs torchao, which is not installed: pip install 'd9d-hf[float8]' "
                "(or 'd9d[float8]'), or remove model.float8"
            )
        if self.recipe == "rowwise" and self.fsdp_float8_all_gather:
            raise ValueError(
                "model.float8.fsdp_float8_all_gather needs model.float8.recipe: tensorwise (torchao "
                "gathers float8 weights with one scale per tensor); set it false for rowwise"
            )
        match self.expert_weight_casts:
            case "per_microbatch":
                pass
            case "per_step":
                if not self.experts:
                    raise ValueError(
                        "model.float8.expert_weight_casts: per_step needs model.float8.experts: true "
                        "(it keeps the float8 casts of the experts' weights)"
                    )
        self.training()  # the remaining checks (exclude patterns)
        return self

    def training(self) -> Float8Training:
        """The d9d-parallel settings of the linear layers."""
        return Float8Training(
            recipe=self.recipe,
            fsdp_float8_all_gather=self.fsdp_float8_all_gather,
            exclude=self.exclude,
            min_features=self.min_features,
            emulate=self.emulate,
        )


class FsdpConfig(BaseModel):
    """``model: {fsdp: {...}}``: how FSDP shards the stage where it shards (2+ data-parallel ranks).

    Every option leaves the gradients the same up to the reduction dtype; they trade memory and
    precision for communication that overlaps compute on host-bound ranks. Measure each one.

    Attributes:
        reduce_dtype: Dtype of the gradient reduce-scatter (and HSDP all-reduce): ``float32``
            (default, exact sums of bf16 gradients) or ``bfloat16`` (half the bytes on the wire,
            sums rounded to bf16). Applies with ``param_dtype`` set or not.
        forward_prefetch: Each decoder layer's forward also starts the all-gathers of this many
            following layers (0: FSDP's implicit prefetch only, the next layer when the host
            reaches it). Holds up to ``1 + forward_prefetch`` gathered layers at a time.
        backward_prefetch: The same in backward, for the layers before it (0: implicit).
        keep_last_layer_gathered: The stage's last decoder layer keeps its gathered parameters
            from forward to backward (it runs backward first): one all-gather less per step,
            its full parameters held in between.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    forward_prefetch: int = Field(default=0, ge=0)
    backward_prefetch: int = Field(default=0, ge=0)
    keep_last_layer_gathered: bool = False

    def settings(self) -> FsdpSettings:
        """The recipe's settings."""
        return FsdpSettings(
            reduce_dtype=torch.bfloat16 if self.reduce_dtype == "bfloat16" else torch.float32,
            forward_prefetch=self.forward_prefetch,
            backward_prefetch=self.backward_prefetch,
            keep_last_layer_gathered=self.keep_last_layer_gathered,
        )


class _ModelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    head: HeadName = "causal_lm"
    activation_checkpointing: bool = False
    attention_backend: AttentionBackendName | None = None
    param_dtype: ParamDtype | None = None
    master_dtype: MasterDtype = "float32"
    compile: bool = False
    last_stage_weight: float = Field(default=0.0, ge=0.0)
    expert_bias_update_rate: float | None = Field(default=None, gt=0.0)
    load_balancing_loss: bool | None = None
    heads: tuple[HeadConfig, ...] | None = None
    float8: Float8Config | None = None
    fsdp: FsdpConfig = FsdpConfig()

    @model_validator(mode="after")
    def _master_dtype_computes_in_itself(self) -> _ModelOptions:
        if self.master_dtype == "bfloat16" and self.param_dtype not in (None, "bfloat16"):
            raise ValueError(
                f"model.master_dtype: bfloat16 computes in bfloat16; model.param_dtype must be bfloat16 "
                f"or unset, got {self.param_dtype}"
            )
        return self

    @property
    def compute_dtype(self) -> ParamDtype | None:
        """The dtype forward and backward run in (None: the parameters' own, float32)."""
        return "bfloat16" if self.master_dtype == "bfloat16" else self.param_dtype

    @model_validator(mode="after")
    def _float8_experts_in_bf16(self) -> _ModelOptions:
        if self.float8 is not None and self.float8.experts and self.compute_dtype != "bfloat16":
            raise ValueError(
                f"model.float8.experts needs model.param_dtype: bfloat16 (the FP8 grouped GEMM takes "
                f"and returns bf16), got {self.param_dtype}"
            )
        return self

    def model_heads(self) -> DecoderHead | list[DecoderHead]:
        """The heads every stage is built with: ``head``'s one head (the model returns its output)
        or the ``heads`` list (the model returns every head's output by name)."""
        return head_named(self.head) if self.heads is None else head_specs(self.heads)

    @model_validator(mode="after")
    def _one_way_to_name_heads(self) -> _ModelOptions:
        if self.heads is None:
            return self
        if "head" in self.model_fields_set:
            raise ValueError("set either head (one head) or heads (several), not both")
        if "num_labels" in self.model_fields_set:
            raise ValueError("with heads, each classification head names its own num_labels")
        check_head_specs(head_specs(self.heads))
        return self


class PretrainedModelConfig(_ModelOptions):
    """``model: {source: Qwen/Qwen3-0.6B, head: causal_lm}``: start from a checkpoint.

    Attributes:
        source: A Hub repo id or a local directory (config.json, safetensors, tokenizer files).
        revision: Branch, tag or commit of a Hub repo.
        head: The head to train; one the checkpoint lacks (a classifier on a causal-LM checkpoint)
            starts from a fresh initialization, the backbone from the checkpoint.
        heads: Several heads on the backbone instead of ``head`` (``CausalLMHeadConfig``,
            ``ClassificationHeadConfig``; at most one ``causal_lm``), each with its loss weight
            and metrics; train them with ``multi_head_task``. The LM head loads from the
            checkpoint (or its tie), a classification head from ``head-<name>.safetensors``
            beside it (an earlier export), else it starts fresh. Export writes the backbone
            and the LM head as a transformers directory, each classification head as
            ``head-<name>.safetensors`` with ``head-<name>.json`` beside it.
        num_labels: Classes of a fresh sequence-classification head (default: the config's; 1
            for a reward model).
        pad_token_id: The padding token id, replacing the config's (a checkpoint whose
            config.json names none): a sequence-classification head reads each row's score at
            its last token that is not padding, and the export's config.json carries it.
        activation_checkpointing: Recompute every decoder layer in backward.
        attention_backend: Attention implementation; None auto-detects.
        param_dtype: Compute dtype of the parameters (FSDP mixed precision); None keeps float32.
        master_dtype: Dtype the parameters are stored, checkpointed, reduced into and stepped in:
            ``float32`` (master weights beside bf16 compute) or ``bfloat16`` (no float32 copy:
            half the parameter and gradient memory and traffic; gradients are still reduced
            across ranks in float32 unless ``fsdp.reduce_dtype`` says otherwise). Pair
            ``bfloat16`` with ``optimizer: {name: stochastic_adamw}``, whose stochastic rounding
            keeps the updates that round-to-nearest bf16 would lose. Exports are then bf16.
        compile: Compile each decoder layer's body with ``torch.compile`` (regional compilation).
        last_stage_weight: Under pipeline parallelism, the extra cost of the last stage (final
            norm, head and loss) in decoder layers, so that it gets fewer layers (0: an even split).
            The head's FLOPs over one layer's: ``vocab x hidden`` over a layer's parameters plus
            ``seq x heads x head_dim`` (attention); a Qwen3-0.6B head at seq 4096 weighs about 6.4.
        float8: FP8 training of the linear layers (and optionally the MoE experts) through
            torchao (``Float8Config``); None trains in ``param_dtype``. Converted before tensor
            parallelism and FSDP; LoRA layers run their frozen base in FP8 and their adapters in
            bf16 (LoRA on FP8 experts is refused when the stage is parallelized).
        fsdp: FSDP's reduction dtype, explicit prefetch and resharding (``FsdpConfig``), where
            the stage is sharded over more than one data-parallel rank.
        expert_bias_update_rate: Auxiliary-loss-free MoE balancing: every router selects experts by
            score plus a per-expert bias (starting at 0, not exported) that moves by this rate
            after each step, up for experts that got fewer tokens than the mean and down for those
            that got more, counted over every rank of the stage (DeepSeek-V3 uses 0.001). None:
            off. Only for models with MoE layers; the bias is checkpointed with the model.
        load_balancing_loss: Whether training adds the MoE load-balancing loss
            (``router_aux_loss_coef`` times one Switch loss pooled over every sparse layer, as
            transformers computes it). None follows config.json's ``output_router_logits``, as
            transformers does (Qwen's own configs ship false: no auxiliary loss); true or false
            overrides it, and the export's config.json says the same. Only for models with MoE
            layers.
    """

    source: str = Field(min_length=1)
    revision: str | None = None
    num_labels: int | None = Field(default=None, ge=1)
    pad_token_id: int | None = Field(default=None, ge=0)


class ScratchModelConfig(_ModelOptions):
    """``model: {config: {model_type: qwen3, hidden_size: ...}}``: pre-train freshly initialized.

    Attributes:
        config: The model's config.json content (``model_type`` selects the family).
        tokenizer: A directory whose tokenizer files are exported with the model.

    The other fields are ``PretrainedModelConfig``'s.
    """

    config: DecoderConfig
    tokenizer: Path | None = None


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "pretrained" if "source" in value else "scratch"
    return "pretrained" if isinstance(value, PretrainedModelConfig) else "scratch"


HFModelConfig = Annotated[
    Annotated[PretrainedModelConfig, Tag("pretrained")] | Annotated[ScratchModelConfig, Tag("scratch")],
    Discriminator(_kind),
]
"""A Hugging Face model for d9d-loop: with ``source`` a checkpoint, with ``config`` from scratch."""
