"""Launch-geometry helpers shared by the Triton ops (no Triton import here)."""

import functools

import torch

from d9d.kernels._backend import triton_interpreter_enabled


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small fixed count in Triton's CPU interpreter."""
    if device.type != "cuda":
        return 2
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def warps_for_block(block: int) -> int:
    """A warp count that gives each thread a handful of elements of a ``block``-wide row."""
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    if block >= 512:
        return 4
    return 2


def interpreted() -> bool:
    """Whether kernels run in Triton's interpreter (where bf16 ``tl.dot`` must be upcast)."""
    return triton_interpreter_enabled()
