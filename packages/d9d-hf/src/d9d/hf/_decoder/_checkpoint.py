"""Decoder models from and to Hugging Face checkpoints: checks, weights, the exported config.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from d9d.hf._decoder._expert_bias import expert_bias_names
from d9d.hf._decoder._heads import head_of
from d9d.hf._decoder._model_base import DecoderModelBase
from d9d.hf._decoder._state_mapper import (
    HF_HEAD_TENSORS,
    decoder_export_mapper,
    decoder_load_mapper,
    hf_prefix,
)
from d9d.loop.peft import view_of, without_adapters
from d9d.state_mappers import (
    CastMapper,
    ParallelMapper,
    SafetensorsCheckpoint,
    SequentialMapper,
    StateMapper,
    TensorSpec,
    load_module_state,
    validate_mapping,
)


def base_state_module(module: nn.Module) -> nn.Module:
    """``module``'s own tensors under their names, without LoRA adapters (``d9d.loop.peft``) and
    without the job's MoE selection biases (``expert_bias_names``).

    An HF checkpoint holds the base model only: with adapters injected (a LoRA run), they are
    no target of loading or checking; they start at ``B = 0`` afterwards, the biases at 0. The
    same tensor objects, so loading into the view fills ``module`` (sharded tensors stay sharded).
    """
    base = without_adapters(module)
    biases = set(expert_bias_names(base))
    if not biases:
        return base
    return view_of({k: v for k, v in base.state_dict(keep_vars=True).items() if k not in biases})


def _state_specs(model: DecoderModelBase) -> dict[str, TensorSpec]:
    return {
        name: TensorSpec(shape=tuple(t.shape), dtype=t.dtype)
        for name, t in base_state_module(model).state_dict().items()
    }


def export_mapper_of(model: DecoderModelBase) -> StateMapper:
    """``decoder_export_mapper`` for ``model``'s family, head and stage."""
    return decoder_export_mapper(model.config, head_of(model), model.layout)


def check_checkpoint(checkpoint: SafetensorsCheckpoint, model: DecoderModelBase) -> None:
    """Checks that the checkpoint holds every tensor ``model``'s stage needs, in the config's shapes.

    Reads headers only. Run before any weight is read or any memory is allocated.

    Raises:
        ValueError: Naming the file and tensor of each missing or mis-shaped tensor.
    """
    head = head_of(model)
    hf_specs = validate_mapping(export_mapper_of(model), _state_specs(model)).output_specs
    source = checkpoint.specs
    source_prefix = "model." if any(name.startswith("model.") for name in source) else ""
    problems: list[str] = []
    for name, spec in hf_specs.items():
        stored_name = name if name in HF_HEAD_TENSORS else source_prefix + name.removeprefix(hf_prefix(head))
        if stored_name not in source:
            problems.append(f"{checkpoint.path}: missing tensor {stored_name!r}")
        elif source[stored_name].shape != spec.shape:
            problems.append(
                f"{checkpoint.file_of(stored_name)}: tensor {stored_name!r} has shape "
                f"{list(source[stored_name].shape)}, the config needs {list(spec.shape)}"
            )
    if problems:
        raise ValueError("checkpoint does not fit its config.json: " + "; ".join(problems))


def load_weights(
    model: DecoderModelBase, source: Path | str | SafetensorsCheckpoint, *, show_progress: bool = True
) -> None:
    """Fills a materialized (possibly sharded, possibly one-stage) model of any family from an HF checkpoint.

    Each stage reads only its own tensors, each DTensor rank only its slice; tensors are cast to
    the model's dtypes on the way. LoRA adapters in ``model`` are left alone.
    """
    checkpoint = source if isinstance(source, SafetensorsCheckpoint) else SafetensorsCheckpoint(source)
    check_checkpoint(checkpoint, model)
    target = base_state_module(model)
    targets = target.state_dict()
    mapper = decoder_load_mapper(
        model.config, head_of(model), source_names=checkpoint.specs.keys(), target_names=targets.keys()
    )
    dtypes = {name: tensor.dtype for name, tensor in targets.items()}
    casts = ParallelMapper([CastMapper(name, dtype) for name, dtype in dtypes.items()])
    load_module_state(checkpoint, target, SequentialMapper([mapper, casts]), show_progress=show_progress)


def export_config(model: DecoderModelBase, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of ``model`` as transformers would write it for its head and dtype."""
    content = model.config.to_json_dict()
    content["architectures"] = [model.config.hf_architecture(head_of(model))]
    dtype_name = str(dtype).removeprefix("torch.")
    content["dtype"] = dtype_name
    if "torch_dtype" in content:
        content["torch_dtype"] = dtype_name
    return content
