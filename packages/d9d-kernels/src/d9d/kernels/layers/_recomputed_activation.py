"""Saved-tensor hooks that let backward recompute an elementwise activation instead of keeping it."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Recompute:
    """Stands in a saved-tensor slot for a view of the activation."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@contextmanager
def recompute_when_saved(activation: torch.Tensor, recompute: Callable[[], torch.Tensor]) -> Generator[None]:
    """Within the block, ops that save ``activation`` (or a view of it) keep ``recompute`` instead.

    For an activation computed cheaply from tensors that backward keeps anyway (SwiGLU's output
    from its gate and up projections): the next layer's backward calls ``recompute`` (under
    ``no_grad``) when it needs the input, so the activation's memory is freed after forward. Only
    plain tensors are matched (subclasses such as DTensor are saved as usual), and nothing is
    matched while compiling (the compiler decides what to save itself).

    Args:
        activation: The tensor whose saved copies are to be recomputed.
        recompute: Returns a tensor equal to ``activation`` (same values, shape and dtype).
    """
    if torch.compiler.is_compiling() or type(activation) is not torch.Tensor:
        yield
        return
    pointer = activation.untyped_storage().data_ptr()  # an address, not a reference: no memory kept

    def pack(tensor: torch.Tensor) -> torch.Tensor | _Recompute:
        if type(tensor) is torch.Tensor and tensor.untyped_storage().data_ptr() == pointer:
            return _Recompute(tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))
        return tensor

    def unpack(saved: torch.Tensor | _Recompute) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        with torch.no_grad():
            again = recompute()
        return again.as_strided(saved.size, saved.stride, saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
