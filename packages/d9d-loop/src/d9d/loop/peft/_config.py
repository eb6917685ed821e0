"""Which parameters a run trains: all of them, or LoRA adapters (plus chosen extras)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class FullFineTuningConfig(BaseModel):
    """Train every parameter (the default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["full"] = "full"


class LoRAConfig(BaseModel):
    """Low-rank adapters on the linear layers whose names match ``target``; the rest is frozen.

    ``y = base(x) + (alpha / r) * B(A(dropout(x)))`` with ``A`` of shape ``[r, in]`` (Kaiming
    uniform, as nn.Linear) and ``B`` of shape ``[out, r]`` (zeros), so step 0 equals the base model.

    Attributes:
        target: A regular expression searched in each ``nn.Linear``'s qualified name
            (``q_proj|v_proj``, ``layers\\.\\d+\\.mlp``); it must match at least one.
        r: The adapters' rank (at most the layer's smaller side).
        alpha: The scale numerator (the update is scaled by ``alpha / r``).
        dropout: Dropout on the adapter's input (training only).
        trainable: A regular expression of parameter names trained in full beside the adapters
            (a fresh classification head, say); None: only the adapters.
        export: What ``Trainer.export`` writes: ``merged``, the plain model with every adapter
            folded into its weight (``W + alpha / r * B @ A``) through the provider's export
            mapper; or ``adapters``, PEFT's ``adapter_model.safetensors`` + ``adapter_config.json``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["lora"] = "lora"
    target: str = Field(min_length=1)
    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    trainable: str | None = None
    export: Literal["merged", "adapters"] = "merged"


PeftConfig = Annotated[FullFineTuningConfig | LoRAConfig, Field(discriminator="kind")]
"""``{kind: full}`` or ``{kind: lora, target: ..., r: ..., alpha: ...}``."""
