"""The model class of each head, and the head of a model."""

from __future__ import annotations

from typing import Any

from d9d.hf._decoder._causal_lm import DecoderCausalLM
from d9d.hf._decoder._embedding import DecoderEmbedding
from d9d.hf._decoder._family import DecoderFamily
from d9d.hf._decoder._model_base import DecoderModelBase
from d9d.hf._decoder._multi_head import DecoderMultiHead
from d9d.hf._decoder._sequence_classification import DecoderSequenceClassification
from d9d.hf._head import HeadName


def head_of(model: DecoderModelBase) -> HeadName:
    """The head a decoder model carries; for several heads, the one of its transformers export
    (``causal_lm`` with a language-model head, else the bare backbone's ``embedding``)."""
    if isinstance(model, DecoderMultiHead):
        return "embedding" if model.language_model_head is None else "causal_lm"
    if isinstance(model, DecoderCausalLM):
        return "causal_lm"
    if isinstance(model, DecoderSequenceClassification):
        return "sequence_classification"
    if isinstance(model, DecoderEmbedding):
        return "embedding"
    raise TypeError(f"{type(model).__name__} is not a decoder model of d9d.hf")


def build_decoder(config: DecoderFamily, head: HeadName, **kwargs: Any) -> DecoderModelBase:
    """Builds the model of any family for ``head`` (keyword arguments go to its constructor)."""
    match head:
        case "causal_lm":
            return DecoderCausalLM(config, **kwargs)
        case "sequence_classification":
            return DecoderSequenceClassification(config, **kwargs)
        case "embedding":
            return DecoderEmbedding(config, **kwargs)
