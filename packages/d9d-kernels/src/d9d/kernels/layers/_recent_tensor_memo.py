"""Values computed from the last few distinct tensors, kept while those tensors come back unchanged."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass(kw_only=True, frozen=True)
class _Entry(Generic[T]):
    """One tensor's value: the tensor held weakly, and its version counter when the value was computed."""

    tensor: weakref.ref[torch.Tensor]
    version: int
    value: T


class RecentTensorMemo(Generic[T]):
    """``compute(tensor)`` for the last ``capacity`` distinct tensors seen, reused while each is unchanged.

    Every attention layer of a forward gets the same ``document_ids`` tensor, so what a shared
    backend derives from it (offsets, a block mask) is computed once per tensor instead of once per
    layer. Several tensors are kept, not just the latest: a pipeline schedule runs microbatch 2's
    forward between microbatch 1's forward and the recompute of its backward, and interleaved
    gradient-accumulation microbatches come back in turn; each finds its value again.

    An entry is a tensor's identity and its version counter: an in-place change (a reused input
    buffer) computes the value again and replaces the entry. Tensors are held weakly, so the memo
    never keeps one alive (a value that holds its own tensor would, until evicted); the entry of a
    freed tensor is dropped at the next call. Beyond ``capacity`` the least recently used entry
    goes. Inference tensors have no version counter and are never kept.
    """

    def __init__(self, compute: Callable[[torch.Tensor], T], *, capacity: int = 8) -> None:
        """
        Args:
            compute: Derives the value from a tensor; called again whenever the tensor changes.
            capacity: How many distinct tensors' values are kept (at least 1).

        Raises:
            ValueError: If ``capacity`` is below 1.
        """
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._compute = compute
        self._capacity = capacity
        # keyed by id() of a live tensor; the weak reference tells a reused id apart
        self._entries: OrderedDict[int, _Entry[T]] = OrderedDict()

    def __call__(self, tensor: torch.Tensor) -> T:
        """``compute(tensor)``, reused while ``tensor`` is one of the recent ones and unchanged since."""
        if tensor.is_inference():
            return self._compute(tensor)
        self._drop_freed()
        # the version counter has no public accessor; autograd's saved-tensor checks read the same one
        version: int = tensor._version  # pyright: ignore[reportPrivateUsage]
        key = id(tensor)
        entry = self._entries.get(key)
        if entry is not None and entry.tensor() is tensor and entry.version == version:
            self._entries.move_to_end(key)
            return entry.value
        # a stale entry goes first, so a failing compute leaves no value of the old contents behind
        self._entries.pop(key, None)
        value = self._compute(tensor)
        self._entries[key] = _Entry(tensor=weakref.ref(tensor), version=version, value=value)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        """How many tensors' values are kept (freed tensors' entries dropped first)."""
        self._drop_freed()
        return len(self._entries)

    def _drop_freed(self) -> None:
        """Drops the entries whose tensors are gone, releasing their values."""
        for key in [key for key, entry in self._entries.items() if entry.tensor() is None]:
            del self._entries[key]
