"""Splitting and joining pytrees of tensors along a tensor dim.

A tree is a tensor, a ``dict``, ``list`` or ``tuple`` of trees, or a dataclass instance whose fields
are trees. Any other leaf (None, numbers, strings) is not split: every shard gets it unchanged.
Used to cut a batch into microbatches and across data-parallel ranks without user code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

TreeT = TypeVar("TreeT")


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def map_tree(tree: TreeT, fn: Callable[[torch.Tensor, str], Any], path: str = "") -> TreeT:
    """Applies ``fn(tensor, path)`` to every tensor of a tree, keeping its structure."""
    obj: Any = tree
    if isinstance(obj, torch.Tensor):
        return cast(TreeT, fn(obj, path or "<root>"))
    if isinstance(obj, dict):
        items = cast(dict[Any, Any], obj).items()
        return cast(TreeT, {k: map_tree(v, fn, f"{path}.{k}" if path else str(k)) for k, v in items})
    if isinstance(obj, list | tuple):
        seq = cast(Sequence[Any], obj)
        mapped = [map_tree(v, fn, f"{path}[{i}]") for i, v in enumerate(seq)]
        if isinstance(obj, list):
            return cast(TreeT, mapped)
        if hasattr(seq, "_fields"):  # a namedtuple takes its fields positionally
            return cast(TreeT, cast(Callable[..., Any], type(seq))(*mapped))
        return cast(TreeT, tuple(mapped))
    if _is_dataclass_instance(obj):
        changes = {
            f.name: map_tree(getattr(obj, f.name), fn, f"{path}.{f.name}" if path else f.name)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return cast(TreeT, dataclasses.replace(obj, **changes))
    return tree


def tree_tensors(tree: object) -> list[tuple[str, torch.Tensor]]:
    """Lists ``(path, tensor)`` for every tensor in a tree, in traversal order."""
    found: list[tuple[str, torch.Tensor]] = []

    def visit(t: torch.Tensor, path: str) -> torch.Tensor:
        found.append((path, t))
        return t

    map_tree(tree, visit)
    return found


def _shard_size(tensor: torch.Tensor, path: str, num_shards: int, dim: int) -> int:
    """The size of one of ``num_shards`` equal pieces along ``dim``; raises naming the tensor's path."""
    if tensor.ndim <= dim:
        raise ValueError(f"cannot split tensor '{path}' of shape {tuple(tensor.shape)} along dim {dim}")
    if tensor.shape[dim] % num_shards != 0:
        raise ValueError(
            f"tensor '{path}' has size {tensor.shape[dim]} along dim {dim}, "
            f"not divisible into {num_shards} shards"
        )
    return tensor.shape[dim] // num_shards


def shard_tree(tree: TreeT, *, num_shards: int, dim: int = 0) -> list[TreeT]:
    """Splits every tensor of a tree into ``num_shards`` equal pieces along ``dim``.

    Args:
        tree: The tree to split.
        num_shards: Number of pieces.
        dim: Tensor dim to split along.

    Returns:
        ``num_shards`` trees of the same structure.

    Raises:
        ValueError: If a tensor's size along ``dim`` is not divisible by ``num_shards``; the error
            names the tensor's path in the tree.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    tensors = tree_tensors(tree)
    pieces = [
        tuple(torch.split(tensor, _shard_size(tensor, path, num_shards, dim), dim=dim))
        for path, tensor in tensors
    ]
    if num_shards == 1:
        return [tree]
    shards: list[TreeT] = []
    for index in range(num_shards):
        shard_pieces = iter([p[index] for p in pieces])
        shards.append(map_tree(tree, lambda _t, _p, it=shard_pieces: next(it)))
    return shards


def shard_tree_at(tree: TreeT, *, index: int, num_shards: int, dim: int = 0) -> TreeT:
    """Returns piece ``index`` of ``num_shards`` equal pieces of every tensor along ``dim``."""

    def take(tensor: torch.Tensor, path: str) -> torch.Tensor:
        step = _shard_size(tensor, path, num_shards, dim)
        return tensor.narrow(dim, index * step, step)

    return map_tree(tree, take)


def unshard_tree(shards: Sequence[TreeT], *, dim: int = 0) -> TreeT:
    """Joins trees of the same structure by concatenating their tensors along ``dim``.

    Non-tensor leaves are taken from the first shard.
    """
    if not shards:
        raise ValueError("unshard_tree needs at least one shard")
    columns = [tree_tensors(s) for s in shards]
    joined = iter(torch.cat([col[i][1] for col in columns], dim=dim) for i in range(len(columns[0])))
    return map_tree(shards[0], lambda _t, _p: next(joined))
