"""Decoder models from and to Hugging Face checkpoints: checks, export names, the exported config.json."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from d9d.hf._decoder._expert_bias import expert_bias_names
from d9d.hf._decoder._heads import DecoderHead, export_head_of
from d9d.hf._decoder._model import DecoderModel
from d9d.hf._decoder._quantized_tensors import dequantized_specs, file_of
from d9d.hf._decoder._state_mapper import (
    HF_HEAD_TENSORS,
    decoder_export_mapper,
    hf_prefix,
)
from d9d.loop.peft import view_of, without_adapters
from d9d.state_mappers import SafetensorsCheckpoint, StateMapper, TensorSpec, validate_mapping


def base_state_module(module: nn.Module, *, keep_expert_bias: bool = False) -> nn.Module:
    """``module``'s own tensors under their names, without LoRA adapters (``d9d.loop.peft``) and
    without the job's MoE selection biases (``expert_bias_names``) unless ``keep_expert_bias``
    (a family whose checkpoint holds them: ``DecoderSpec.checkpoint_expert_bias``).

    An HF checkpoint holds the base model only: with adapters injected (a LoRA run), they are
    no target of loading or checking; they start at ``B = 0`` afterwards, the biases at 0. The
    same tensor objects, so loading into the view fills ``module`` (sharded tensors stay sharded).
    """
    base = without_adapters(module)
    biases: set[str] = set() if keep_expert_bias else set(expert_bias_names(base))
    if not biases:
        return base
    return view_of({k: v for k, v in base.state_dict(keep_vars=True).items() if k not in biases})


def heads_state_module(model: DecoderModel, heads: Sequence[DecoderHead]) -> nn.Module:
    """``base_state_module(model)`` with the tensors of the backbone and of ``heads`` only."""
    others = tuple(head.module_path + "." for head in model.head_specs if head not in heads)
    keep = model.spec.checkpoint_expert_bias
    state = base_state_module(model, keep_expert_bias=keep).state_dict(keep_vars=True)
    return view_of({name: t for name, t in state.items() if not name.startswith(others)})


def export_mapper_of(model: DecoderModel) -> StateMapper:
    """``decoder_export_mapper`` for ``model``'s family, heads and stage."""
    return decoder_export_mapper(model.config, model.head_specs, model.layout)


def check_checkpoint(
    checkpoint: SafetensorsCheckpoint, model: DecoderModel, heads: Sequence[DecoderHead] | None = None
) -> None:
    """Checks that the checkpoint holds every tensor of the stage's backbone and ``heads`` (default:
    every head of ``model``), in the config's shapes.

    Reads headers only. Run before any weight is read or any memory is allocated.

    Raises:
        ValueError: Naming the file and tensor of each missing or mis-shaped tensor.
    """
    heads = model.head_specs if heads is None else heads
    _refuse_layers_beyond(checkpoint, model.spec.num_layers)
    view = heads_state_module(model, heads)
    specs = {name: TensorSpec(shape=tuple(t.shape), dtype=t.dtype) for name, t in view.state_dict().items()}
    mapper = decoder_export_mapper(model.config, heads, model.layout)
    hf_specs = validate_mapping(mapper, specs).output_specs
    source = dequantized_specs(checkpoint)  # an MXFP4 pair counts as its bf16 tensor
    source_prefix = "model." if any(name.startswith("model.") for name in source) else ""
    prefix = hf_prefix(export_head_of(heads))
    problems: list[str] = []
    for name, spec in hf_specs.items():
        stored_name = name if name in HF_HEAD_TENSORS else source_prefix + name.removeprefix(prefix)
        if stored_name not in source:
            problems.append(f"{checkpoint.path}: missing tensor {stored_name!r}")
        elif source[stored_name].shape != spec.shape:
            problems.append(
                f"{file_of(checkpoint, stored_name)}: tensor {stored_name!r} has shape "
                f"{list(source[stored_name].shape)}, the config needs {list(spec.shape)}"
            )
    if problems:
        raise ValueError("checkpoint does not fit its config.json: " + "; ".join(problems))


def _refuse_layers_beyond(checkpoint: SafetensorsCheckpoint, num_layers: int) -> None:
    """Raises naming the first tensor of a layer at or past ``num_layers`` (``model.layers.{N}.*``).

    Such layers are multi-token-prediction modules (DeepSeek-V3's ``num_nextn_predict_layers``),
    which d9d does not implement: refused rather than dropped, so no weight is lost unnoticed.
    """
    for name in sorted(checkpoint.specs):
        parts = name.removeprefix("model.").split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= num_layers:
            raise ValueError(
                f"{checkpoint.file_of(name)}: tensor {name!r} belongs to layer {parts[1]}, past "
                f"num_hidden_layers={num_layers}: a multi-token-prediction module (DeepSeek-V3's "
                "num_nextn_predict_layers), which d9d does not implement; remove those tensors "
                "from the checkpoint to train without them"
            )


def head_files(model: DecoderModel) -> dict[str, bytes]:
    """The files every head exports beside the transformers directory (``head-<name>.*``).

    Every rank of the last stage must call it: a sharded head is gathered.
    """
    files: dict[str, bytes] = {}
    for head, module in model.head_modules():
        files.update(head.export_files(module, model.spec))
    return files


def export_config(model: DecoderModel, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of ``model`` as transformers would write it for its heads and dtype."""
    content = model.config.to_json_dict()
    content["architectures"] = [model.config.hf_architecture(model.export_head)]
    dtype_name = str(dtype).removeprefix("torch.")
    content["dtype"] = dtype_name
    if "torch_dtype" in content:
        content["torch_dtype"] = dtype_name
    return content
