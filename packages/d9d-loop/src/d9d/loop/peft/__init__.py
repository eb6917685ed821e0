"""Parameter-efficient fine-tuning: LoRA adapters injected by name, the rest frozen."""

from d9d.loop.peft._config import FullFineTuningConfig, LoRAConfig, PeftConfig
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
from d9d.loop.peft._lora import LoRALinear
from d9d.loop.peft._tensor_parallel import place_adapters_like_base

__all__ = [
    "FullFineTuningConfig",
    "GroupedExperts",
    "GroupedLoRAExperts",
    "LoRAConfig",
    "LoRALinear",
    "LoRATargetError",
    "PeftConfig",
    "apply_peft",
    "inject_lora",
    "is_adapter",
    "merged_state",
    "place_adapters_like_base",
    "reset_adapters",
    "trainable_names",
    "view_of",
    "without_adapters",
]
