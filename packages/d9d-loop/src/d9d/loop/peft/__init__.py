"""Parameter-efficient fine-tuning: LoRA adapters injected by name, the rest frozen."""

from d9d.loop.peft._config import (
    BaseWeightsConfig,
    FullFineTuningConfig,
    LoRAConfig,
    NF4BaseConfig,
    PeftConfig,
    PlainBaseConfig,
)
from d9d.loop.peft._grouped import GroupedExperts, GroupedLoRAExperts
from d9d.loop.peft._inject import (
    LoRATargetError,
    apply_peft,
    inject_lora,
    is_adapter,
    merged_state,
    reset_adapters,
    trainable_names,
    view_of,
    without_adapters,
)
from d9d.loop.peft._lora import LoRALinear, QuantizedWeight
from d9d.loop.peft._nf4 import (
    NF4Weight,
    QuantizationReport,
    check_quantizable,
    quantize_bases,
    refuse_quantized_base_on_mesh,
    stage_bases_on_host,
)
from d9d.loop.peft._tensor_parallel import place_adapters_like_base

__all__ = [
    "BaseWeightsConfig",
    "FullFineTuningConfig",
    "GroupedExperts",
    "GroupedLoRAExperts",
    "LoRAConfig",
    "LoRALinear",
    "LoRATargetError",
    "NF4BaseConfig",
    "NF4Weight",
    "PeftConfig",
    "PlainBaseConfig",
    "QuantizationReport",
    "QuantizedWeight",
    "apply_peft",
    "check_quantizable",
    "inject_lora",
    "is_adapter",
    "merged_state",
    "place_adapters_like_base",
    "quantize_bases",
    "refuse_quantized_base_on_mesh",
    "reset_adapters",
    "stage_bases_on_host",
    "trainable_names",
    "view_of",
    "without_adapters",
]
