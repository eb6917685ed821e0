"""A value computed from a tensor, kept while the same tensor comes back unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class LatestTensorMemo(Generic[T]):
    """``compute(tensor)`` for the latest tensor seen, reused while that tensor comes back unchanged.

    Every attention layer of a forward gets the same ``document_ids`` tensor, so what a shared
    backend derives from it (offsets, a block mask) is computed once per forward instead of once per
    layer. The tensor's version counter catches an in-place change (a reused input buffer), which
    computes the value again; inference tensors have no version counter and are never kept.
    """

    def __init__(self, compute: Callable[[torch.Tensor], T]) -> None:
        """
        Args:
            compute: Derives the value from a tensor; called again whenever the tensor changes.
        """
        self._compute = compute
        self._tensor: torch.Tensor | None = None
        self._version = -1
        self._value: T | None = None

    def __call__(self, tensor: torch.Tensor) -> T:
        """``compute(tensor)``, reused while ``tensor`` is the one seen last and unchanged since."""
        if tensor.is_inference():
            return self._compute(tensor)
        # the version counter has no public accessor; autograd's saved-tensor checks read the same one
        version: int = tensor._version  # pyright: ignore[reportPrivateUsage]
        if self._value is None or tensor is not self._tensor or version != self._version:
            self._value = self._compute(tensor)
            self._tensor, self._version = tensor, version
        return self._value
