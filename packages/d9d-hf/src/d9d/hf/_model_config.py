"""The ``model:`` section of a job: start from a Hugging Face checkpoint, or pre-train from scratch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from d9d.hf._decoder import check_head_specs
from d9d.hf._families import DecoderConfig
from d9d.hf._head import HeadName
from d9d.hf._head_config import HeadConfig, head_specs
from d9d.kernels.layers import AttentionBackendName

ParamDtype = Literal["float32", "bfloat16", "float16"]
"""Dtype of the gathered parameters in forward/backward (FSDP mixed precision); gradients are
reduced and the optimizer steps in float32."""


class _ModelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    head: HeadName = "causal_lm"
    activation_checkpointing: bool = False
    attention_backend: AttentionBackendName | None = None
    param_dtype: ParamDtype | None = None
    compile: bool = False
    last_stage_weight: float = Field(default=0.0, ge=0.0)
    expert_bias_update_rate: float | None = Field(default=None, gt=0.0)
    heads: tuple[HeadConfig, ...] | None = None

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
        num_labels: Classes of a fresh sequence-classification head (default: the config's).
        activation_checkpointing: Recompute every decoder layer in backward.
        attention_backend: Attention implementation; None auto-detects.
        param_dtype: Compute dtype of the parameters (FSDP mixed precision); None keeps float32.
        compile: Compile each decoder layer's body with ``torch.compile`` (regional compilation).
        last_stage_weight: Under pipeline parallelism, the extra cost of the last stage (final
            norm, head and loss) in decoder layers, so that it gets fewer layers (0: an even split).
            The head's FLOPs over one layer's: ``vocab x hidden`` over a layer's parameters plus
            ``seq x heads x head_dim`` (attention); a Qwen3-0.6B head at seq 4096 weighs about 6.4.
        expert_bias_update_rate: Auxiliary-loss-free MoE balancing: every router selects experts by
            score plus a per-expert bias (starting at 0, not exported) that moves by this rate
            after each step, up for experts that got fewer tokens than the mean and down for those
            that got more, counted over every rank of the stage (DeepSeek-V3 uses 0.001). None:
            off. Only for models with MoE layers; the bias is checkpointed with the model.
    """

    source: str = Field(min_length=1)
    revision: str | None = None
    num_labels: int | None = Field(default=None, ge=1)


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
