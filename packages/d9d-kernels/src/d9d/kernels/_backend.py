"""Choosing between the Triton kernels and the PyTorch reference implementations."""

from __future__ import annotations

import enum
import importlib.util
import os

import torch

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KernelBackend(enum.StrEnum):
    """Which implementation an op runs.

    Attributes:
        AUTO: Triton when every tensor argument is on a CUDA device, has a supported floating dtype
            and Triton is installed; the PyTorch reference otherwise. Under ``torch.compile`` the
            elementwise and row-wise ops (RMSNorm, SwiGLU, RoPE) run their reference, which
            Inductor fuses with the code around them (residual adds, casts, projections' epilogues)
            instead of calling an opaque kernel between two fused regions.
        TRITON: Always the Triton kernels; raises where they cannot run. On CPU tensors this works
            only under Triton's interpreter (``TRITON_INTERPRET=1``), which the tests use.
        REFERENCE: Always the plain PyTorch implementation (runs on any device, differentiable
            through PyTorch's own autograd).
    """

    AUTO = "auto"
    TRITON = "triton"
    REFERENCE = "reference"


def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported (it is absent on most non-Linux machines)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _installed() -> bool:
    # torch.compile cannot trace importlib; compiling for CUDA needs Triton anyway (Inductor).
    return torch.compiler.is_compiling() or triton_installed()


def use_triton(backend: KernelBackend, op: str, *tensors: torch.Tensor, fusible: bool = False) -> bool:
    """Resolves ``backend`` for one call of ``op`` on ``tensors``.

    Args:
        backend: The requested backend.
        op: The op's name, for error messages.
        *tensors: The floating-point tensor arguments that the kernels read.
        fusible: The reference is code Inductor lowers and fuses well (elementwise or one
            reduction per row): under ``torch.compile``, AUTO then picks the reference.

    Returns:
        True to run the Triton kernels, False to run the PyTorch reference.

    Raises:
        RuntimeError: ``backend`` is TRITON but Triton is missing, a tensor is on a device Triton
            cannot run on, or a dtype is not supported by the kernels.
    """
    match backend:
        case KernelBackend.REFERENCE:
            return False
        case KernelBackend.AUTO:
            if fusible and torch.compiler.is_compiling():
                return False
            return all(t.is_cuda and t.dtype in _TRITON_DTYPES for t in tensors) and _installed()
        case KernelBackend.TRITON:
            if not _installed():
                raise RuntimeError(f"{op}: backend=triton but the triton package is not installed")
            for t in tensors:
                if t.dtype not in _TRITON_DTYPES:
                    raise RuntimeError(f"{op}: backend=triton does not support dtype {t.dtype}")
                if not t.is_cuda and not triton_interpreter_enabled():
                    raise RuntimeError(
                        f"{op}: backend=triton needs CUDA tensors (got device {t.device}); "
                        "set TRITON_INTERPRET=1 to run the kernels on CPU in Triton's interpreter"
                    )
            return True
