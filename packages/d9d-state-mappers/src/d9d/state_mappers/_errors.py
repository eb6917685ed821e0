"""Exceptions raised by state mappers and the safetensors reader and writer."""

from __future__ import annotations

from collections.abc import Iterable


class StateMappingError(ValueError):
    """A mapper graph does not fit its source or target; the message lists every offending name."""


class CheckpointFormatError(ValueError):
    """A safetensors file or index is missing, truncated or malformed; the message names the file."""


def format_names(names: Iterable[str], *, limit: int = 20) -> str:
    """Formats names as a sorted, quoted list, eliding the tail past ``limit`` names."""
    ordered = sorted(names)
    shown = ", ".join(repr(n) for n in ordered[:limit])
    if len(ordered) > limit:
        shown += f", ... and {len(ordered) - limit} more"
    return f"[{shown}]"
