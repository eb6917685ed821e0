"""Launch-geometry helpers shared by the Triton ops (no Triton import here)."""

from typing import Any

import torch

from d9d.kernels._backend import triton_interpreter_enabled


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy where its last dim is strided (kernels index it with ``+ d``)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_options(**options: Any) -> dict[str, Any]:
    """Keyword arguments of a kernel launch (constexprs, num_warps), untyped for the checker.

    Triton's ``JITFunction`` presents the kernel's signature to type checkers, where launch-only
    keywords (num_warps) do not exist and ``tl.constexpr`` parameters reject plain ints.
    """
    return options


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
