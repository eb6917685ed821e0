"""Stacking tensors along a new dim and splitting them back (per-expert <-> fused expert weights)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from d9d.state_mappers._group import GroupPlan, MapperGroup
from d9d.state_mappers._multi import check_dim, check_same_spec, check_unique
from d9d.state_mappers._spec import (
    Box,
    TensorPiece,
    TensorSpec,
    box_insert_dim,
    box_remove_dim,
    box_shape,
    box_union_all,
)


class StackMapper(MapperGroup):
    """Stacks ``sources`` (equal shapes and dtypes) along a new tensor dim ``dim`` into ``target``.

    A slice of the output along ``dim`` reads only the sources it covers: an expert-sharded rank
    reads only its experts.
    """

    def __init__(self, sources: Sequence[str], target: str, *, dim: int = 0) -> None:
        if not sources:
            raise ValueError(f"stack into {target!r} needs at least one source")
        check_unique(f"stack into {target!r}", sources)
        self._sources = tuple(sources)
        self._target = target
        self._dim = dim

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset(self._sources)

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset((self._target,))

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        what = f"stack into {self._target!r}"
        spec = check_same_spec(what, self._sources, input_specs)
        check_dim(what, self._dim, len(spec.shape) + 1)
        shape = (*spec.shape[: self._dim], len(self._sources), *spec.shape[self._dim :])
        return {self._target: TensorSpec(shape=shape, dtype=spec.dtype)}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        if self._target not in output_boxes:
            return GroupPlan()
        out_box = output_boxes[self._target]
        dtype = input_specs[self._sources[0]].dtype
        start, stop = out_box[self._dim]
        in_box = box_remove_dim(out_box, self._dim)
        chosen = self._sources[start:stop]
        dim, target = self._dim, self._target

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            if not chosen:
                return {target: torch.empty(box_shape(out_box), dtype=dtype)}
            return {target: torch.stack([pieces[name].narrow(in_box) for name in chosen], dim=dim)}

        return GroupPlan(input_boxes=dict.fromkeys(chosen, in_box), run=run)

    def __repr__(self) -> str:
        return f"StackMapper({len(self._sources)} tensors -> {self._target!r}, dim={self._dim})"


class UnstackMapper(MapperGroup):
    """Splits ``source`` along tensor dim ``dim`` into ``targets``, one per index (dim removed)."""

    def __init__(self, source: str, targets: Sequence[str], *, dim: int = 0) -> None:
        if not targets:
            raise ValueError(f"unstack of {source!r} needs at least one target")
        check_unique(f"unstack of {source!r}", targets)
        self._source = source
        self._targets = tuple(targets)
        self._dim = dim

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset((self._source,))

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset(self._targets)

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        spec = input_specs[self._source]
        what = f"unstack of {self._source!r}"
        check_dim(what, self._dim, len(spec.shape))
        if spec.shape[self._dim] != len(self._targets):
            raise ValueError(
                f"{what}: tensor dim {self._dim} has size {spec.shape[self._dim]} "
                f"but {len(self._targets)} targets are named"
            )
        shape = (*spec.shape[: self._dim], *spec.shape[self._dim + 1 :])
        return {t: TensorSpec(shape=shape, dtype=spec.dtype) for t in self._targets}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        boxes = {
            target: box_insert_dim(output_boxes[target], self._dim, (index, index + 1))
            for index, target in enumerate(self._targets)
            if target in output_boxes
        }
        if not boxes:
            return GroupPlan()
        in_box = box_union_all(list(boxes.values()))
        source, dim = self._source, self._dim

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            piece = pieces[source]
            return {target: piece.narrow(box).select(dim, 0) for target, box in boxes.items()}

        return GroupPlan(input_boxes={source: in_box}, run=run)

    def __repr__(self) -> str:
        return f"UnstackMapper({self._source!r} -> {len(self._targets)} tensors, dim={self._dim})"
