"""Pytrees of tensors: stage inputs and outputs, batches and their microbatches.

A tree is a tensor, or a ``dict``, ``list``, ``tuple`` (named tuples included) or dataclass
instance of trees; any other value (None, a number, a string) is a constant leaf that travels with
the structure. Flattening gives the tensors in a
fixed order and a *skeleton*: the structure with each tensor replaced by its position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch


@dataclass(frozen=True)
class _Slot:
    index: int


@dataclass(frozen=True)
class _Node:
    """A dataclass instance or named tuple in a skeleton: its type and its children by field."""

    kind: type
    fields: tuple[tuple[str, object], ...]


def _namedtuple_fields(obj: object) -> tuple[str, ...] | None:
    fields: object = getattr(type(obj), "_fields", None)
    if isinstance(obj, tuple) and isinstance(fields, tuple):
        return cast(tuple[str, ...], fields)
    return None


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def flatten_tree(tree: object) -> tuple[list[torch.Tensor], object, list[str]]:
    """Returns the tensors of ``tree`` in order, its skeleton, and each tensor's path."""
    tensors: list[torch.Tensor] = []
    paths: list[str] = []

    def visit(node: object, path: str) -> object:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            paths.append(path or "<root>")
            return _Slot(len(tensors) - 1)
        if isinstance(node, dict):
            items = cast(dict[Any, Any], node).items()
            return {k: visit(v, f"{path}.{k}" if path else str(k)) for k, v in items}
        names = _namedtuple_fields(node)
        if names is not None:
            values = cast(Sequence[Any], node)
            return _Node(
                kind=type(node),
                fields=tuple(
                    (n, visit(v, f"{path}.{n}" if path else n)) for n, v in zip(names, values, strict=True)
                ),
            )
        if isinstance(node, list | tuple):
            children = [visit(v, f"{path}[{i}]") for i, v in enumerate(cast(Sequence[Any], node))]
            return children if isinstance(node, list) else tuple(children)
        if _is_dataclass_instance(node):
            return _Node(
                kind=type(node),
                fields=tuple(
                    (f.name, visit(getattr(node, f.name), f"{path}.{f.name}" if path else f.name))
                    for f in dataclasses.fields(cast(Any, node))
                    if f.init
                ),
            )
        return node

    skeleton = visit(tree, "")
    return tensors, skeleton, paths


def unflatten_tree(skeleton: object, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuilds a tree from its skeleton and tensors (the inverse of :func:`flatten_tree`)."""
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, _Node):
        return skeleton.kind(**{name: unflatten_tree(child, tensors) for name, child in skeleton.fields})
    if isinstance(skeleton, dict):
        return {k: unflatten_tree(v, tensors) for k, v in cast(dict[Any, Any], skeleton).items()}
    if isinstance(skeleton, list | tuple):
        children = [unflatten_tree(v, tensors) for v in cast(Sequence[Any], skeleton)]
        return children if isinstance(skeleton, list) else tuple(children)
    return skeleton


def split_microbatches(tree: Any, num_microbatches: int) -> list[Any]:
    """Splits every tensor of ``tree`` into ``num_microbatches`` equal pieces along tensor dim 0.

    Constant leaves are shared by every piece.

    Raises:
        ValueError: If a tensor has no dim 0 or its size is not divisible; the error names the
            tensor's path in the tree.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    tensors, skeleton, paths = flatten_tree(tree)
    pieces: list[tuple[torch.Tensor, ...]] = []
    for tensor, path in zip(tensors, paths, strict=True):
        if tensor.ndim == 0 or tensor.shape[0] % num_microbatches != 0:
            raise ValueError(
                f"cannot split tensor '{path}' of shape {tuple(tensor.shape)} into {num_microbatches} "
                "microbatches along dim 0"
            )
        pieces.append(tensor.chunk(num_microbatches, dim=0))
    return [unflatten_tree(skeleton, [p[i] for p in pieces]) for i in range(num_microbatches)]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a stage's inputs or outputs."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def needs_grad(self) -> bool:
        """Whether a gradient travels back for this tensor (floating-point and complex tensors)."""
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True)
class TreeSpec:
    """Structure, shapes and dtypes of a tree, as exchanged between neighbouring stages."""

    skeleton: object
    tensors: tuple[TensorSpec, ...]
    paths: tuple[str, ...]

    def describe(self) -> str:
        """``{path: (shape, dtype), ...}`` for error messages."""
        items = ", ".join(
            f"{p}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            for p, t in zip(self.paths, self.tensors, strict=True)
        )
        return "{" + items + "}"

    def grad_indices(self) -> list[int]:
        """Positions of the tensors that carry gradients back."""
        return [i for i, t in enumerate(self.tensors) if t.needs_grad]

    def empty(self, device: torch.device) -> tuple[list[torch.Tensor], Any]:
        """Fresh tensors of this spec on ``device`` (receive buffers) and the tree built from them."""
        tensors = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in self.tensors]
        return tensors, unflatten_tree(self.skeleton, tensors)


def spec_of(tree: object) -> TreeSpec:
    """The :class:`TreeSpec` of a tree."""
    tensors, skeleton, paths = flatten_tree(tree)
    return TreeSpec(
        skeleton=skeleton,
        tensors=tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors),
        paths=tuple(paths),
    )


def to_meta(tree: Any) -> Any:
    """The tree with every tensor replaced by an empty meta tensor of its shape and dtype."""
    tensors, skeleton, _ = flatten_tree(tree)
    return unflatten_tree(skeleton, [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors])
