"""Which parameters a run trains: all of them, or LoRA adapters (plus chosen extras)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PlainBaseConfig(BaseModel):
    """The frozen base stays as loaded (in ``model.param_dtype``, bf16 on one GPU): the default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["plain"] = "plain"


class NF4BaseConfig(BaseModel):
    """The frozen base weight of every LoRA layer stored in 4-bit NormalFloat (QLoRA's NF4).

    Through bitsandbytes (the ``quant`` extra: ``pip install 'd9d-loop[quant]'``). Each base
    weight is quantized on the device right after the base is loaded, one layer at a time (the
    bf16 weights of the adapted layers wait on the host while loading), and its bf16 copy is
    freed. The forward computes ``base(x)`` with the weight dequantized to the compute dtype, plus
    the adapters in that dtype; only the adapters (and ``peft.trainable``) train. Embeddings,
    norms, the head and grouped experts stay as loaded. Exports merge: the dequantized base plus
    ``alpha / r * B @ A``, saved in the base's dtype.

    Attributes:
        block_size: Weights per absmax block (64: QLoRA's; larger blocks store fewer scales and
            quantize a little worse).
        double_quant: Store the block scales themselves in 8 bits (blocks of 256 scales):
            about 0.37 bits per weight less, at no measurable error (QLoRA's double quantization).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["nf4"] = "nf4"
    block_size: Literal[64, 128, 256] = 64
    double_quant: bool = True


BaseWeightsConfig = Annotated[PlainBaseConfig | NF4BaseConfig, Field(discriminator="kind")]
"""``{kind: plain}`` (default) or ``{kind: nf4, block_size: 64, double_quant: true}``."""


class FullFineTuningConfig(BaseModel):
    """Train every parameter (the default).

    Attributes:
        base: Only ``plain``: every weight trains, and a quantized (``nf4``) base cannot; it is
            refused here, before anything loads.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["full"] = "full"
    base: BaseWeightsConfig = PlainBaseConfig()

    @model_validator(mode="after")
    def _base_trains(self) -> FullFineTuningConfig:
        if isinstance(self.base, NF4BaseConfig):
            raise ValueError(
                "peft.base: {kind: nf4} needs peft.kind: lora: a 4-bit base is frozen, and full "
                "fine-tuning would train every weight of it; use {kind: lora, target: ..., base: "
                "{kind: nf4}} or remove peft.base"
            )
        return self


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
        base: How the frozen base of the adapted layers is stored: as loaded (``plain``), or
            4-bit NF4 (``nf4``, QLoRA; its export must be ``merged``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["lora"] = "lora"
    target: str = Field(min_length=1)
    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    trainable: str | None = None
    export: Literal["merged", "adapters"] = "merged"
    base: BaseWeightsConfig = PlainBaseConfig()

    @model_validator(mode="after")
    def _quantized_base_exports_merged(self) -> LoRAConfig:
        if isinstance(self.base, NF4BaseConfig) and self.export == "adapters":
            raise ValueError(
                "peft.export=adapters with peft.base: {kind: nf4}: the adapters were trained on the "
                "4-bit base and do not fit the bf16 one they would be applied to; set peft.export: "
                "merged (the dequantized base with the adapters folded in, which transformers loads)"
            )
        return self


PeftConfig = Annotated[FullFineTuningConfig | LoRAConfig, Field(discriminator="kind")]
"""``{kind: full}`` or ``{kind: lora, target: ..., r: ..., alpha: ...}``."""
