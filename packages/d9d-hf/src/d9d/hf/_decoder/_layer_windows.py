"""Per-layer attention windows from transformers' ``layer_types`` / ``max_window_layers`` fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

LayerType = Literal["full_attention", "sliding_attention"]
"""A layer's attention in transformers' ``layer_types``."""


def resolve_layer_types(
    layer_types: Sequence[LayerType] | None, *, window: int | None, max_window_layers: int, num_layers: int
) -> list[LayerType]:
    """Each layer's attention: ``layer_types``, else sliding from ``max_window_layers`` on (with a window).

    Raises:
        ValueError: If ``layer_types`` does not have one entry per layer.
    """
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries, num_hidden_layers={num_layers}")
        return list(layer_types)
    return [
        "sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
        for i in range(num_layers)
    ]


def layer_windows(
    layer_types: Sequence[LayerType] | None, *, window: int | None, max_window_layers: int, num_layers: int
) -> tuple[int | None, ...]:
    """Per layer, its attention window (None: full attention), as transformers builds them.

    Args:
        layer_types: config.json's ``layer_types`` (None: derived).
        window: The sliding window when ``use_sliding_window`` (else None: no layer slides).
        max_window_layers: Layers from this index on slide when ``layer_types`` is absent.
        num_layers: Decoder layers.
    """
    types = resolve_layer_types(
        layer_types, window=window, max_window_layers=max_window_layers, num_layers=num_layers
    )
    return tuple(window if kind == "sliding_attention" else None for kind in types)
