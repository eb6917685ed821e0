"""The float8 casts of MoE expert weights, kept from one microbatch to the next within a step.

With gradient accumulation (or pipeline microbatches) every forward and backward of the FP8
experts casts the same weights again: column-major per expert for the forward product, row-major
for the input gradient. ``Float8WeightCasts`` keeps both casts of each weight until the weights
change, so they are cast once per optimizer step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from d9d.parallel._float8_rowwise_casts import cast_weight_columns, cast_weight_rows


@dataclass(frozen=True, kw_only=True)
class WeightCasts:
    """The float8 casts of one or more ``(G, K, N_i)`` weights that share an input.

    Attributes:
        columns: Per weight: float8 column-major per group and its scales ``(G, 1, N_i)``.
        rows: All weights joined to ``(G, K, sum N_i)``: row-major float8 and its scales
            ``(G, K, 1)``.
    """

    columns: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    rows: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class _Entry:
    weights: tuple[weakref.ref[torch.Tensor], ...]
    versions: tuple[int, ...]
    casts: WeightCasts

    def holds(self, weights: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> bool:
        alive = all(ref() is weight for ref, weight in zip(self.weights, weights, strict=True))
        return alive and self.versions == versions


def _version(weight: torch.Tensor) -> int:
    # autograd's version counter: every in-place write (an optimizer step without FSDP, a
    # copy_ of new weights) bumps it; no public API exposes it
    return weight._version  # pyright: ignore[reportPrivateUsage]


def _cast(weights: tuple[torch.Tensor, ...]) -> WeightCasts:
    with torch.no_grad():
        columns = tuple(cast_weight_columns(weight) for weight in weights)
        return WeightCasts(columns=columns, rows=cast_weight_rows(*weights))


class Float8WeightCasts:
    """Float8 casts of expert weights, computed once per optimizer step instead of per microbatch.

    An entry is the casts of one tensor (or one tuple of tensors, the gate and up weights), found
    by the tensors' identity and valid while they live, keep their version counter and
    ``clear`` has not run. Call ``clear`` after every optimizer step: FSDP updates the sharded
    parameters and gathers into unsharded tensors whose version counter it preserves, so only
    the step itself tells that they changed. Weights cast anew for each forward (float32
    parameters cast to bf16 on one rank without FSDP) are new tensors every microbatch: their
    entries never hit and are dropped with them.

    The casts stay in memory until ``clear``: one float8 copy of every expert weight in each
    layout, about the bf16 weights' size (a rank under FSDP keeps the whole gathered copies).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], _Entry] = {}
        self._hits = 0
        self._misses = 0
        # eager under torch.compile (a graph break): the lookup reads Python state per call
        self._lookup = cast(Callable[..., WeightCasts], torch.compiler.disable(self._cached_casts))

    @property
    def hits(self) -> int:
        """Lookups answered from an entry since construction."""
        return self._hits

    @property
    def misses(self) -> int:
        """Lookups that cast the weights since construction."""
        return self._misses

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drops every entry: call it after each optimizer step (and after loading new weights)."""
        self._entries.clear()

    def casts(self, *weights: torch.Tensor) -> WeightCasts:
        """The casts of ``weights``: kept ones if the same tensors were cast since ``clear`` and
        are unchanged, else new ones, which are kept. Runs eagerly under ``torch.compile``."""
        return self._lookup(weights)

    def _cached_casts(self, weights: tuple[torch.Tensor, ...]) -> WeightCasts:
        if torch.is_inference_mode_enabled() or any(weight.is_inference() for weight in weights):
            # inference tensors have no version counter, and casts made in inference mode could
            # not be saved for a later training step's backward: cast, keep nothing
            return _cast(weights)
        key = tuple(id(weight) for weight in weights)
        versions = tuple(_version(weight) for weight in weights)
        entry = self._entries.get(key)
        if entry is not None and entry.holds(weights, versions):
            self._hits += 1
            return entry.casts
        self._misses += 1
        casts = _cast(weights)
        drop = self._dropper(key)
        refs = tuple(weakref.ref(weight, drop) for weight in weights)
        self._entries[key] = _Entry(weights=refs, versions=versions, casts=casts)
        return casts

    def _dropper(self, key: tuple[int, ...]) -> Callable[[weakref.ref[torch.Tensor]], None]:
        owner = weakref.ref(self)

        def drop(_dead: weakref.ref[torch.Tensor]) -> None:
            # a dead tensor's id may be reused: its entry must go before that can happen
            live = owner()
            if live is not None:
                live._entries.pop(key, None)

        return drop
