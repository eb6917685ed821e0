"""A several-head decoder from and to Hugging Face checkpoints.

Loading: the backbone (and the language-model head, when the checkpoint has it or it is tied)
from the checkpoint; a classification head from its ``head-<name>.safetensors`` beside the
checkpoint (an earlier export of the model), else freshly initialized. Export: the backbone and the
language-model head under transformers' names (a directory transformers loads), every
classification head as its own safetensors file with a small JSON config beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.hf._decoder._checkpoint import base_state_module, export_mapper_of
from d9d.hf._decoder._head_specs import ClassificationHeadSpec
from d9d.hf._decoder._multi_head import DecoderMultiHead
from d9d.hf._decoder._state_mapper import decoder_load_mapper
from d9d.loop.peft import view_of
from d9d.state_mappers import (
    CastMapper,
    DropMapper,
    ParallelMapper,
    SafetensorsCheckpoint,
    SelectMapper,
    SequentialMapper,
    StateMapper,
    TensorSpec,
    load_module_state,
    validate_mapping,
)

HEADS_PREFIX = "heads."


def head_file_names(name: str) -> tuple[str, str]:
    """The export's ``(tensors, config)`` file names of the classification head ``name``."""
    return f"head-{name}.safetensors", f"head-{name}.json"


def language_model_head_loaded(model: DecoderMultiHead, checkpoint: SafetensorsCheckpoint) -> bool:
    """Whether the checkpoint gives the language-model head its values (its tensor, or a tie)."""
    if model.language_model_head is None:
        return False
    return model.spec.tie_word_embeddings or "lm_head.weight" in checkpoint.specs


def _loaded_view(model: DecoderMultiHead, checkpoint: SafetensorsCheckpoint) -> nn.Module:
    with_lm = language_model_head_loaded(model, checkpoint)
    state = base_state_module(model).state_dict(keep_vars=True)
    return view_of(
        {
            name: tensor
            for name, tensor in state.items()
            if not name.startswith(HEADS_PREFIX) and (with_lm or name != "lm_head.weight")
        }
    )


def _directory(checkpoint: SafetensorsCheckpoint) -> Path:
    return checkpoint.path if checkpoint.path.is_dir() else checkpoint.path.parent


def saved_head(
    checkpoint: SafetensorsCheckpoint, spec: ClassificationHeadSpec, hidden_size: int
) -> SafetensorsCheckpoint | None:
    """The head's file beside the checkpoint (an earlier export), or None; its config checked.

    Raises:
        ValueError: If the file's JSON config names another kind, class count or width.
    """
    weights, config_name = head_file_names(spec.name)
    directory = _directory(checkpoint)
    if not (directory / weights).is_file():
        return None
    config_path = directory / config_name
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
    wanted = {"kind": "classification", "num_labels": spec.num_labels, "hidden_size": hidden_size}
    wrong = {key: config.get(key) for key, value in wanted.items() if config.get(key) != value}
    if wrong:
        raise ValueError(f"{config_path}: head {spec.name!r} needs {wanted}, the file says {wrong}")
    return SafetensorsCheckpoint(directory / weights)


def _saved_heads(
    model: DecoderMultiHead, checkpoint: SafetensorsCheckpoint
) -> dict[str, SafetensorsCheckpoint]:
    if not model.layout.is_last:
        return {}
    found = {
        spec.name: saved_head(checkpoint, spec, model.spec.hidden_size) for spec in model.classification_heads
    }
    return {name: file for name, file in found.items() if file is not None}


def _head_mapper(head: nn.Module, file: SafetensorsCheckpoint) -> StateMapper:
    state = base_state_module(head).state_dict()
    mapper = SequentialMapper(
        [SelectMapper(state.keys()), ParallelMapper([CastMapper(name, t.dtype) for name, t in state.items()])]
    )
    validate_mapping(mapper, file.specs, {name: TensorSpec.of(t) for name, t in state.items()})
    return mapper


def multi_head_load_mapper(model: DecoderMultiHead, checkpoint: SafetensorsCheckpoint) -> StateMapper:
    """The checked mapper from the checkpoint to the part of ``model`` it fills (see the module).

    Raises:
        StateMappingError: Naming every tensor the mapping leaves unused or unfilled.
    """
    view = _loaded_view(model, checkpoint)
    state = view.state_dict()
    head = "causal_lm" if language_model_head_loaded(model, checkpoint) else "embedding"
    mapper = SequentialMapper(
        [
            decoder_load_mapper(
                model.config, head, source_names=checkpoint.specs.keys(), target_names=state.keys()
            ),
            ParallelMapper([CastMapper(name, t.dtype) for name, t in state.items()]),
        ]
    )
    validate_mapping(mapper, checkpoint.specs, {name: TensorSpec.of(t) for name, t in state.items()})
    for name, file in _saved_heads(model, checkpoint).items():
        _head_mapper(model.heads[name], file)  # raises now, on the meta device, if it does not fit
    return mapper


def load_multi_head_stage(
    model: DecoderMultiHead, checkpoint: SafetensorsCheckpoint, *, show_progress: bool
) -> None:
    """Fills a materialized stage: the checkpoint's part and the saved heads (this rank's slices),
    fresh heads for the rest."""
    model.reset_buffers()
    model.reset_heads(language_model=not language_model_head_loaded(model, checkpoint))
    load_module_state(
        checkpoint,
        _loaded_view(model, checkpoint),
        multi_head_load_mapper(model, checkpoint),
        show_progress=show_progress,
    )
    for name, file in _saved_heads(model, checkpoint).items():
        head = model.heads[name]
        load_module_state(file, base_state_module(head), _head_mapper(head, file), show_progress=False)


def multi_head_export_mapper(model: DecoderMultiHead) -> StateMapper:
    """The stage's state -> transformers' tensors of the backbone and LM head (other heads dropped)."""
    names = [name for name in base_state_module(model).state_dict() if name.startswith(HEADS_PREFIX)]
    if not names:
        return export_mapper_of(model)
    return ParallelMapper([export_mapper_of(model), DropMapper(names)])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the host (collective over its mesh when sharded)."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().cpu().contiguous()


def classification_head_files(model: DecoderMultiHead) -> dict[str, bytes]:
    """Each classification head's ``head-<name>.safetensors`` and ``head-<name>.json`` (last stage).

    Every rank of the stage must call it: a sharded head is gathered. The tensors keep the
    head's state names (``classifier.weight``); the JSON names the kind, classes, width and pooling.
    """
    files: dict[str, bytes] = {}
    if not model.layout.is_last:
        return files
    for spec in model.classification_heads:
        head = model.heads[spec.name]
        tensors = {name: _full(t) for name, t in head.state_dict().items()}
        weights, config_name = head_file_names(spec.name)
        files[weights] = save(tensors)
        config: dict[str, Any] = {
            "kind": "classification",
            "name": spec.name,
            "num_labels": spec.num_labels,
            "hidden_size": model.spec.hidden_size,
            "pooling": "last",
            "bias": False,
            "dtype": str(tensors["classifier.weight"].dtype).removeprefix("torch."),
        }
        files[config_name] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return files
