"""Qwen3 models from and to Hugging Face directories: config.json, head choice, checks, weights."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pydantic
import torch
from torch import nn

from d9d.hf._head import HeadName
from d9d.hf.qwen3._causal_lm import Qwen3CausalLM
from d9d.hf.qwen3._config import QWEN3_CONFIG_ADAPTER, Qwen3DenseConfig, Qwen3MoeConfig
from d9d.hf.qwen3._embedding import Qwen3Embedding
from d9d.hf.qwen3._model_base import Qwen3ModelBase
from d9d.hf.qwen3._sequence_classification import Qwen3SequenceClassification
from d9d.hf.qwen3._state_mapper import HF_HEAD_TENSORS, hf_prefix, qwen3_export_mapper, qwen3_load_mapper
from d9d.loop.peft import without_adapters
from d9d.state_mappers import (
    CastMapper,
    ParallelMapper,
    SafetensorsCheckpoint,
    SequentialMapper,
    TensorSpec,
    load_module_state,
    validate_mapping,
)

CONFIG_FILE = "config.json"


def read_qwen3_config(directory: Path | str) -> Qwen3DenseConfig | Qwen3MoeConfig:
    """Reads and validates ``directory/config.json``.

    Raises:
        ValueError: Naming the file and every offending field: another ``model_type`` or
            ``architectures``, an unknown field, a value d9d does not implement.
    """
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{path}: no config.json") from error
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from error
    try:
        return QWEN3_CONFIG_ADAPTER.validate_python(raw)
    except pydantic.ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or '<root>'}: {e['msg']}" for e in error.errors()
        )
        raise ValueError(f"{path}: not a supported Qwen3 / Qwen3-MoE config: {problems}") from error


def head_of(model: Qwen3ModelBase) -> HeadName:
    """The head a Qwen3 model carries."""
    if isinstance(model, Qwen3CausalLM):
        return "causal_lm"
    if isinstance(model, Qwen3SequenceClassification):
        return "sequence_classification"
    if isinstance(model, Qwen3Embedding):
        return "embedding"
    raise TypeError(f"{type(model).__name__} is not a Qwen3 model of d9d.hf")


def build_qwen3(config: Qwen3DenseConfig | Qwen3MoeConfig, head: HeadName, **kwargs: Any) -> Qwen3ModelBase:
    """Builds the model for ``head`` (keyword arguments go to its constructor)."""
    match head:
        case "causal_lm":
            return Qwen3CausalLM(config, **kwargs)
        case "sequence_classification":
            return Qwen3SequenceClassification(config, **kwargs)
        case "embedding":
            return Qwen3Embedding(config, **kwargs)


def hf_architecture(config: Qwen3DenseConfig | Qwen3MoeConfig, head: HeadName) -> str:
    """The transformers class name transformers writes for ``head``."""
    family = "Qwen3" if isinstance(config, Qwen3DenseConfig) else "Qwen3Moe"
    match head:
        case "causal_lm":
            return f"{family}ForCausalLM"
        case "sequence_classification":
            return f"{family}ForSequenceClassification"
        case "embedding":
            return f"{family}Model"


def base_state_module(module: nn.Module) -> nn.Module:
    """``module``'s own tensors under their names, without LoRA adapters (``d9d.loop.peft``).

    An HF checkpoint holds the base model only: with adapters injected (a LoRA run), they are
    no target of loading or checking; they start at ``B = 0`` afterwards. The same tensor
    objects, so loading into the view fills ``module`` (sharded tensors stay sharded).
    """
    return without_adapters(module)


def _state_specs(model: Qwen3ModelBase) -> dict[str, TensorSpec]:
    return {
        name: TensorSpec(shape=tuple(t.shape), dtype=t.dtype)
        for name, t in base_state_module(model).state_dict().items()
    }


def check_checkpoint(checkpoint: SafetensorsCheckpoint, model: Qwen3ModelBase) -> None:
    """Checks that the checkpoint holds every tensor ``model``'s stage needs, in the config's shapes.

    Reads headers only. Run before any weight is read or any memory is allocated.

    Raises:
        ValueError: Naming the file and tensor of each missing or mis-shaped tensor.
    """
    head = head_of(model)
    hf_specs = validate_mapping(
        qwen3_export_mapper(model.spec, head, model.layout), _state_specs(model)
    ).output_specs
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


def load_qwen3_weights(
    model: Qwen3ModelBase, source: Path | str | SafetensorsCheckpoint, *, show_progress: bool = True
) -> None:
    """Fills a materialized (possibly sharded, possibly one-stage) Qwen3 model from an HF checkpoint.

    Each stage reads only its own tensors, each DTensor rank only its slice; tensors are cast to
    the model's dtypes on the way. LoRA adapters in ``model`` are left alone.
    """
    checkpoint = source if isinstance(source, SafetensorsCheckpoint) else SafetensorsCheckpoint(source)
    check_checkpoint(checkpoint, model)
    target = base_state_module(model)
    targets = target.state_dict()
    mapper = qwen3_load_mapper(
        model.spec, head_of(model), source_names=checkpoint.specs.keys(), target_names=targets.keys()
    )
    dtypes = {name: tensor.dtype for name, tensor in targets.items()}
    casts = ParallelMapper([CastMapper(name, dtype) for name, dtype in dtypes.items()])
    load_module_state(checkpoint, target, SequentialMapper([mapper, casts]), show_progress=show_progress)


def export_config(model: Qwen3ModelBase, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of ``model`` as transformers would write it for its head and dtype."""
    content = model.config.to_json_dict()
    content["architectures"] = [hf_architecture(model.config, head_of(model))]
    dtype_name = str(dtype).removeprefix("torch.")
    content["dtype"] = dtype_name
    if "torch_dtype" in content:
        content["torch_dtype"] = dtype_name
    return content


def write_config(directory: Path, content: dict[str, Any]) -> None:
    """Writes ``directory/config.json`` atomically (a temporary file renamed into place)."""
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".config.", suffix=".json")
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(content, file, indent=2, sort_keys=True)
            file.write("\n")
        Path(temporary).replace(directory / CONFIG_FILE)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
