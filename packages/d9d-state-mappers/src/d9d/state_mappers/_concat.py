"""Concatenating tensors along a dim and chunking them back (fused QKV, fused gate/up)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from d9d.state_mappers._group import GroupPlan, MapperGroup
from d9d.state_mappers._multi import check_dim, check_unique
from d9d.state_mappers._spec import (
    Box,
    TensorPiece,
    TensorSpec,
    box_shape,
    box_union_all,
    box_with_dim,
    full_box,
)


class ConcatenateMapper(MapperGroup):
    """Concatenates ``sources`` along tensor dim ``dim`` into ``target`` (other dims and dtype equal).

    A slice of the output reads only the overlapping part of each source.
    """

    def __init__(self, sources: Sequence[str], target: str, *, dim: int = 0) -> None:
        if not sources:
            raise ValueError(f"concatenate into {target!r} needs at least one source")
        check_unique(f"concatenate into {target!r}", sources)
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
        what = f"concatenate into {self._target!r}"
        first = input_specs[self._sources[0]]
        check_dim(what, self._dim, len(first.shape))
        for name in self._sources[1:]:
            spec = input_specs[name]
            same_rest = len(spec.shape) == len(first.shape) and all(
                a == b for d, (a, b) in enumerate(zip(spec.shape, first.shape, strict=True)) if d != self._dim
            )
            if spec.dtype != first.dtype or not same_rest:
                raise ValueError(
                    f"{what} along dim {self._dim}: {name!r} is {spec} but {self._sources[0]!r} is {first}"
                )
        size = sum(input_specs[name].shape[self._dim] for name in self._sources)
        shape = (*first.shape[: self._dim], size, *first.shape[self._dim + 1 :])
        return {self._target: TensorSpec(shape=shape, dtype=first.dtype)}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        if self._target not in output_boxes:
            return GroupPlan()
        out_box = output_boxes[self._target]
        start, stop = out_box[self._dim]
        boxes: dict[str, Box] = {}
        offset = 0
        for name in self._sources:
            size = input_specs[name].shape[self._dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                boxes[name] = box_with_dim(out_box, self._dim, (lo - offset, hi - offset))
            offset += size
        dtype = input_specs[self._sources[0]].dtype
        dim, target = self._dim, self._target

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            if not boxes:
                return {target: torch.empty(box_shape(out_box), dtype=dtype)}
            return {target: torch.cat([pieces[name].narrow(box) for name, box in boxes.items()], dim=dim)}

        return GroupPlan(input_boxes=boxes, run=run)

    def __repr__(self) -> str:
        return f"ConcatenateMapper({list(self._sources)} -> {self._target!r}, dim={self._dim})"


class ChunkMapper(MapperGroup):
    """Splits ``source`` along tensor dim ``dim`` into ``targets``.

    ``sizes`` gives each target's size along ``dim`` (for grouped-query QKV, whose parts differ);
    when None the dim is split into equal parts.
    """

    def __init__(
        self, source: str, targets: Sequence[str], *, dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        if not targets:
            raise ValueError(f"chunk of {source!r} needs at least one target")
        check_unique(f"chunk of {source!r}", targets)
        if sizes is not None and len(sizes) != len(targets):
            raise ValueError(f"chunk of {source!r}: {len(sizes)} sizes for {len(targets)} targets")
        self._source = source
        self._targets = tuple(targets)
        self._dim = dim
        self._sizes = None if sizes is None else tuple(sizes)

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset((self._source,))

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset(self._targets)

    def _split_sizes(self, spec: TensorSpec) -> tuple[int, ...]:
        what = f"chunk of {self._source!r}"
        check_dim(what, self._dim, len(spec.shape))
        total = spec.shape[self._dim]
        if self._sizes is None:
            if total % len(self._targets) != 0:
                raise ValueError(
                    f"{what}: tensor dim {self._dim} of size {total} does not split into "
                    f"{len(self._targets)} equal parts"
                )
            return (total // len(self._targets),) * len(self._targets)
        if sum(self._sizes) != total:
            raise ValueError(
                f"{what}: sizes {list(self._sizes)} do not sum to tensor dim {self._dim} size {total}"
            )
        return self._sizes

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        spec = input_specs[self._source]
        return {
            target: TensorSpec(
                shape=box_shape(box_with_dim(full_box(spec.shape), self._dim, (0, size))), dtype=spec.dtype
            )
            for target, size in zip(self._targets, self._split_sizes(spec), strict=True)
        }

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        sizes = self._split_sizes(input_specs[self._source])
        boxes: dict[str, Box] = {}
        offset = 0
        for target, size in zip(self._targets, sizes, strict=True):
            if target in output_boxes:
                start, stop = output_boxes[target][self._dim]
                boxes[target] = box_with_dim(output_boxes[target], self._dim, (offset + start, offset + stop))
            offset += size
        if not boxes:
            return GroupPlan()
        source = self._source

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            return {target: pieces[source].narrow(box) for target, box in boxes.items()}

        return GroupPlan(input_boxes={source: box_union_all(list(boxes.values()))}, run=run)

    def __repr__(self) -> str:
        return f"ChunkMapper({self._source!r} -> {list(self._targets)}, dim={self._dim})"
