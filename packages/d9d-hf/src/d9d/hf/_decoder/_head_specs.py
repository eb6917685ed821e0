"""What each head of a several-head decoder is: plain, typed descriptions the core builds from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class LanguageModelHeadSpec:
    """The next-token head (at most one per model): exported with the backbone for transformers.

    Attributes:
        name: The head's name (its key in the model's output dict).
    """

    name: str


@dataclass(kw_only=True, frozen=True)
class ClassificationHeadSpec:
    """A sequence-classification head: the last real token's hidden state to ``num_labels`` logits.

    Attributes:
        name: The head's name (its key in the model's output dict and in ``heads``).
        num_labels: Number of classes.
    """

    name: str
    num_labels: int


HeadSpec = LanguageModelHeadSpec | ClassificationHeadSpec
"""One head of a ``DecoderMultiHead``."""


def check_head_specs(heads: list[HeadSpec]) -> None:
    """Raises ``ValueError`` unless the heads are non-empty, uniquely named (names without dots)
    and hold at most one language-model head."""
    if not heads:
        raise ValueError("a several-head decoder needs at least one head")
    names = [head.name for head in heads]
    if len(set(names)) != len(names):
        raise ValueError(f"head names must be unique, got {names}")
    for name in names:
        if not name or "." in name or "/" in name:
            raise ValueError(f"head name {name!r} must be non-empty, without '.' or '/'")
    if sum(isinstance(head, LanguageModelHeadSpec) for head in heads) > 1:
        raise ValueError("at most one causal_lm head (the exported transformers model has one lm_head)")
