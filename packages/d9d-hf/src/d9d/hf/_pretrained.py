"""One-call loading and saving of Hugging Face checkpoints as single-process d9d models."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from d9d.hf._decoder import (
    DecoderModel,
    build_decoder,
    check_checkpoint,
    export_config,
    export_mapper_of,
    head_files,
    load_weights,
    write_config,
)
from d9d.hf._families import read_decoder_config
from d9d.hf._head import HeadName
from d9d.hf._hub import resolve_snapshot
from d9d.state_mappers import SafetensorsCheckpoint, save_module_state


def load_pretrained(
    source: str | os.PathLike[str],
    *,
    head: HeadName = "causal_lm",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Builds the model of a Hugging Face checkpoint with its weights, in one process.

    Everything is checked before memory is allocated or a weight read: config.json (another
    architecture, an unknown field or value), the index and safetensors headers (an absent
    shard), and every needed tensor's presence and shape. Errors name the file and the key.

    Args:
        source: A local directory or a Hub repo id (see ``resolve_snapshot``).
        head: Which head to build; a checkpoint's other head tensors are ignored.
        dtype: Parameter dtype; None keeps the checkpoint's.
        device: Where to place the model; None is the CPU.

    Returns:
        A ``DecoderModel`` with that one head (of the family config.json names) in eval mode.
    """
    directory = resolve_snapshot(source)
    config = read_decoder_config(directory)
    checkpoint = SafetensorsCheckpoint(directory)
    with torch.device("meta"):
        model = build_decoder(config, head)
    check_checkpoint(checkpoint, model)
    stored = [spec.dtype for spec in checkpoint.specs.values() if spec.dtype.is_floating_point]
    target_dtype = dtype or (stored[0] if stored else torch.float32)
    model.to(dtype=target_dtype)
    model.to_empty(device=device or "cpu")
    model.reset_buffers()
    load_weights(model, checkpoint)
    return model.eval()


def save_pretrained(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Writes a directory transformers loads: safetensors shards, their index, config.json.

    The tensors are written to a temporary directory renamed into place when complete, then
    config.json is added; a failure leaves no directory that looks loadable.

    Args:
        model: A whole (single-stage) d9d.hf model, as ``load_pretrained`` returns.
        directory: Where to write; must not exist or be empty.

    Raises:
        TypeError: If ``model`` is not a d9d.hf model.
        RuntimeError: If ``model`` is one pipeline stage.
    """
    if not isinstance(model, DecoderModel):
        raise TypeError(f"save_pretrained takes a d9d.hf model, got {type(model).__name__}")
    model.require_whole_model("save_pretrained")
    first = next(model.parameters())
    content = export_config(model, first.dtype)
    target = Path(directory)
    save_module_state(target, model, export_mapper_of(model))
    write_config(target, content)
    for name, data in head_files(model).items():  # heads saved beside the transformers model
        (target / name).write_bytes(data)
