"""What an export writes for a LoRA run: the merged plain model, or the adapters in PEFT's format."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from d9d.loop.peft._config import FullFineTuningConfig, LoRAConfig, PeftConfig
from d9d.loop.peft._inject import is_adapter, merged_view, view_of
from d9d.state_mappers import (
    MapperGroup,
    SafetensorsCheckpoint,
    SelectMapper,
    StateMapper,
    convert_checkpoint,
    identity_mapper_from_module,
)

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


class _WithoutAdapterGroups:
    """A provider's export mapper less the groups that read adapters (a merged model has none)."""

    def __init__(self, mapper: StateMapper) -> None:
        self._mapper = mapper

    def groups(self) -> Sequence[MapperGroup]:
        return [g for g in self._mapper.groups() if not any(is_adapter(n) for n in g.inputs)]


def _peft_name(name: str) -> str:
    """``fc1.lora_A`` -> ``base_model.model.fc1.lora_A.weight``; extras keep their names."""
    if is_adapter(name):
        return f"{_PEFT_PREFIX}{name}.weight"
    return f"{_PEFT_PREFIX}{name}"


def export_view(
    model: nn.Module, mapper: StateMapper, config: PeftConfig
) -> tuple[nn.Module, StateMapper, bool]:
    """The module and mapper an export saves for one stage, and whether the provider's extra
    files (``config.json``) belong in it (not in a PEFT adapter directory)."""
    match config:
        case FullFineTuningConfig():
            return model, mapper, True
        case LoRAConfig(export="merged"):
            return merged_view(model), _WithoutAdapterGroups(mapper), True
        case LoRAConfig():
            trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
            view = view_of({_peft_name(n): p for n, p in trained.items()})
            return view, identity_mapper_from_module(view), False


def write_peft_layout(directory: Path, config: PeftConfig, *, base_model: str | None) -> None:
    """Turns an adapters export (shards and index) into PEFT's two files; no-op otherwise."""
    match config:
        case LoRAConfig(export="adapters"):
            pass
        case FullFineTuningConfig() | LoRAConfig():
            return
    # one file: the stages' shards through an identity mapping, no shard limit (adapters are small)
    checkpoint = SafetensorsCheckpoint(directory)
    names = sorted(checkpoint.specs)
    combined = directory.parent / f".{directory.name}.adapters"
    convert_checkpoint(
        checkpoint, combined, SelectMapper(names), max_shard_size_bytes=2**62, show_progress=False
    )
    for old in [*directory.glob("*.safetensors"), directory / "model.safetensors.index.json"]:
        old.unlink()
    (combined / "model-00001-of-00001.safetensors").rename(directory / PEFT_WEIGHTS)
    shutil.rmtree(combined)
    modules = {n.removeprefix(_PEFT_PREFIX) for n in names}
    adapted = sorted(
        {n.rsplit(".", 2)[0] for n in modules if n.endswith((".lora_A.weight", ".lora_B.weight"))}
    )
    extras = sorted(
        {n.rsplit(".", 1)[0] for n in modules if not n.endswith((".lora_A.weight", ".lora_B.weight"))}
    )
    adapter_config = {
        "peft_type": "LORA",
        "base_model_name_or_path": base_model,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": adapted,
        "modules_to_save": extras or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "task_type": None,
    }
    (directory / PEFT_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
