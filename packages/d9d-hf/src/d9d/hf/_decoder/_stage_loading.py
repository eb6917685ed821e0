"""Loading one (parallelized) decoder stage from a checkpoint that may lack the stage's head."""

from __future__ import annotations

from torch import nn

from d9d.hf._decoder._causal_lm import DecoderCausalLM
from d9d.hf._decoder._checkpoint import base_state_module, check_checkpoint, load_weights
from d9d.hf._decoder._heads import head_of
from d9d.hf._decoder._model_base import DecoderModelBase
from d9d.hf._decoder._sequence_classification import DecoderSequenceClassification
from d9d.hf._decoder._state_mapper import decoder_load_mapper
from d9d.state_mappers import (
    CastMapper,
    ParallelMapper,
    RenameMapper,
    SafetensorsCheckpoint,
    SequentialMapper,
    StateMapper,
    TensorSpec,
    load_module_state,
    validate_mapping,
)

BACKBONE_PREFIX = "model."


def has_fresh_head(model: DecoderModelBase, checkpoint: SafetensorsCheckpoint) -> bool:
    """Whether the stage holds a head with parameters whose tensor the checkpoint lacks.

    A sequence-classification head on a causal-LM checkpoint (no ``score.weight``), or an untied
    LM head on a backbone-only checkpoint (no ``lm_head.weight``).
    """
    if not model.layout.is_last:
        return False
    names = checkpoint.specs
    match head_of(model):
        case "causal_lm":
            return not model.spec.tie_word_embeddings and "lm_head.weight" not in names
        case "sequence_classification":
            return "score.weight" not in names
        case "embedding":
            return False


def _casts(module: nn.Module) -> StateMapper:
    state = base_state_module(module).state_dict()
    return ParallelMapper([CastMapper(name, t.dtype) for name, t in state.items()])


def _backbone_mapper(model: DecoderModelBase, checkpoint: SafetensorsCheckpoint) -> StateMapper:
    """Checkpoint -> ``model.model``'s own state names (head tensors dropped unread, adapters untouched)."""
    names = list(base_state_module(model.model).state_dict().keys())
    mapper = decoder_load_mapper(
        model.config,
        "embedding",  # the head with no tensors: only the backbone is mapped
        source_names=checkpoint.specs.keys(),
        target_names=[BACKBONE_PREFIX + name for name in names],
    )
    unprefix = ParallelMapper([RenameMapper(BACKBONE_PREFIX + name, name) for name in names])
    return SequentialMapper([mapper, unprefix, _casts(model.model)])


def stage_load_mapper(model: DecoderModelBase, checkpoint: SafetensorsCheckpoint) -> StateMapper:
    """The checked mapper from the checkpoint to ``model``'s state (to its backbone with a fresh head).

    Raises:
        ValueError: Naming the file and key of a missing or mis-shaped tensor (headers only).
        StateMappingError: Naming every tensor the mapping leaves unused or unfilled.
    """
    fresh = has_fresh_head(model, checkpoint)
    if not fresh:
        check_checkpoint(checkpoint, model)
    target = base_state_module(model.model if fresh else model)
    if fresh:
        mapper = _backbone_mapper(model, checkpoint)
    else:
        state = target.state_dict()
        mapper = SequentialMapper(
            [
                decoder_load_mapper(
                    model.config,
                    head_of(model),
                    source_names=checkpoint.specs.keys(),
                    target_names=state.keys(),
                ),
                _casts(model),
            ]
        )
    specs = {name: TensorSpec.of(t) for name, t in target.state_dict().items()}
    validate_mapping(mapper, checkpoint.specs, specs)
    return mapper


def _reset_head(model: DecoderModelBase) -> None:
    """Initializes the head alone: drawn first from the stage's seed, its values do not depend on
    the backbone (whose values the checkpoint replaces) or on adapters injected into it."""
    if isinstance(model, DecoderSequenceClassification) and model.score is not None:
        model.score.reset_parameters()
    elif isinstance(model, DecoderCausalLM) and model.lm_head is not None:
        model.lm_head.reset_parameters()


def load_stage_from_checkpoint(
    model: DecoderModelBase, checkpoint: SafetensorsCheckpoint, *, show_progress: bool
) -> None:
    """Fills a materialized stage: each rank reads its slices; a fresh head is initialized instead.

    Call after ``to_empty`` (the stage's seed set); non-persistent buffers are recomputed. LoRA
    adapters get no checkpoint values (the loop resets them to ``B = 0`` afterwards).
    """
    if has_fresh_head(model, checkpoint):
        model.reset_buffers()
        _reset_head(model)
        load_module_state(
            checkpoint,
            base_state_module(model.model),
            _backbone_mapper(model, checkpoint),
            show_progress=show_progress,
        )
        return
    model.reset_buffers()
    load_weights(model, checkpoint, show_progress=show_progress)
