"""Loading a (parallelized, one-stage) decoder model from a Hugging Face checkpoint: one path for
every head: what the checkpoint holds is loaded, a head saved beside it comes from its own file,
any other head keeps its fresh initialization."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from d9d.hf._decoder._checkpoint import base_state_module, check_checkpoint, heads_state_module
from d9d.hf._decoder._heads import DecoderHead
from d9d.hf._decoder._model import DecoderModel
from d9d.hf._decoder._quantized_tensors import dequantized_specs, mxfp4_mapper
from d9d.hf._decoder._state_mapper import decoder_load_mapper
from d9d.state_mappers import (
    CastMapper,
    ParallelMapper,
    SafetensorsCheckpoint,
    SelectMapper,
    SequentialMapper,
    StateMapper,
    TensorSpec,
    load_module_state,
    validate_mapping,
)


def loaded_heads(model: DecoderModel, checkpoint: SafetensorsCheckpoint) -> list[DecoderHead]:
    """The heads whose values the checkpoint holds (``DecoderHead.loads_from``)."""
    names = checkpoint.specs.keys()
    return [head for head in model.head_specs if head.loads_from(names, model.spec)]


def _checked(mapper: StateMapper, source: SafetensorsCheckpoint, target: nn.Module) -> StateMapper:
    """``mapper`` then casts to ``target``'s dtypes, validated against both sides' names and shapes."""
    state = target.state_dict()
    whole = SequentialMapper(
        [mapper, ParallelMapper([CastMapper(name, t.dtype) for name, t in state.items()])]
    )
    validate_mapping(whole, source.specs, {name: TensorSpec.of(t) for name, t in state.items()})
    return whole


def _saved_heads(
    model: DecoderModel, checkpoint: SafetensorsCheckpoint
) -> list[tuple[nn.Module, SafetensorsCheckpoint, StateMapper]]:
    """Each head found in its own file beside the checkpoint: its module, file and checked mapper."""
    found: list[tuple[nn.Module, SafetensorsCheckpoint, StateMapper]] = []
    for head, module in model.head_modules():
        file = head.saved_file(checkpoint, model.spec)
        if file is not None:
            target = base_state_module(module)
            found.append((target, file, _checked(SelectMapper(target.state_dict().keys()), file, target)))
    return found


def stage_load_mapper(model: DecoderModel, checkpoint: SafetensorsCheckpoint) -> StateMapper:
    """The checked mapper from the checkpoint to the part of ``model``'s state it fills (the
    backbone and ``loaded_heads``); the files of saved heads are checked too.

    Raises:
        ValueError: Naming the file and key of a missing or mis-shaped tensor (headers only), or a
            saved head's file of another kind or shape.
        StateMappingError: Naming every tensor the mapping leaves unused or unfilled.
    """
    heads = loaded_heads(model, checkpoint)
    check_checkpoint(checkpoint, model, heads)
    target = heads_state_module(model, heads)
    names = target.state_dict().keys()
    source = dequantized_specs(checkpoint)
    mapper = decoder_load_mapper(model.config, heads, source_names=source.keys(), target_names=names)
    if source.keys() != checkpoint.specs.keys():  # MXFP4 pairs, dequantized to bf16 as they stream
        mapper = SequentialMapper([mxfp4_mapper(checkpoint), mapper])
    checked = _checked(mapper, checkpoint, target)
    _saved_heads(model, checkpoint)  # raises now, on the meta device, if a file does not fit
    return checked


def load_stage_from_checkpoint(
    model: DecoderModel, checkpoint: SafetensorsCheckpoint, *, show_progress: bool
) -> None:
    """Fills a materialized stage: each rank reads its slices; a head the checkpoint lacks starts fresh.

    Call after ``to_empty`` (the stage's seed set); non-persistent buffers are recomputed. The
    fresh heads are drawn first from the stage's seed, so their values do not depend on the
    backbone or on adapters; then the checkpoint's tensors and the saved heads are read. LoRA
    adapters get no checkpoint values (the loop resets them to ``B = 0`` afterwards).
    """
    model.reset_buffers()
    heads = loaded_heads(model, checkpoint)
    model.reset_heads([head for head in model.head_specs if head not in heads])
    mapper = stage_load_mapper(model, checkpoint)
    load_module_state(checkpoint, heads_state_module(model, heads), mapper, show_progress=show_progress)
    for target, file, head_mapper in _saved_heads(model, checkpoint):
        load_module_state(file, target, head_mapper, show_progress=False)


def load_weights(
    model: DecoderModel, source: Path | str | SafetensorsCheckpoint, *, show_progress: bool = True
) -> None:
    """Fills a materialized (possibly sharded, possibly one-stage) model of any family from an HF checkpoint.

    Every head exported with the transformers model must be in the checkpoint (``check_checkpoint``).
    Each stage reads only its own tensors, each DTensor rank only its slice; tensors are cast to
    the model's dtypes on the way. LoRA adapters in ``model`` are left alone.
    """
    checkpoint = source if isinstance(source, SafetensorsCheckpoint) else SafetensorsCheckpoint(source)
    check_checkpoint(checkpoint, model)
    load_stage_from_checkpoint(model, checkpoint, show_progress=show_progress)
