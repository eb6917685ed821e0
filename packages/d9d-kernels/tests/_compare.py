"""Comparing an op's Triton path with its PyTorch reference, forward and gradients."""

import os
from collections.abc import Callable, Sequence

import pytest
import torch

from d9d.kernels import KernelBackend

Op = Callable[..., torch.Tensor]

DEVICES = [
    pytest.param(
        "cpu",
        id="cpu-interpreter",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
        ),
    ),  # Triton interpreter (conftest sets TRITON_INTERPRET=1 where no GPU is present), small shapes
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),  # compiled kernels, real shapes
]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def _run(op: Op, inputs: Sequence[torch.Tensor], differentiable: Sequence[int], backend: KernelBackend,
         dtype: torch.dtype, grad_seed: int) -> list[torch.Tensor]:  # fmt: skip
    cast = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    leaves = [
        t.detach().requires_grad_(i in differentiable) if t.is_floating_point() else t
        for i, t in enumerate(cast)
    ]
    out = op(*leaves, backend=backend)
    generator = torch.Generator(device=out.device).manual_seed(grad_seed)
    upstream = torch.randn(out.shape, device=out.device, generator=generator, dtype=torch.float32)
    grads = torch.autograd.grad(out, [leaves[i] for i in differentiable], upstream.to(out.dtype))
    return [out.detach().float(), *(g.float() for g in grads)]


def assert_matches_reference(
    op: Op,
    inputs: Sequence[torch.Tensor],
    differentiable: Sequence[int],
    dtype: torch.dtype,
    *,
    fp32_tolerance: float = 1e-5,
    bf16_slack: float = 2.0,
) -> None:
    """Triton vs reference, forward output and the gradients of ``inputs[i]`` for ``i`` in differentiable.

    fp32: the two agree to ``fp32_tolerance`` (relative to each tensor's scale). bf16: the Triton
    result is no further from the fp32 reference than ``bf16_slack`` times the bf16 reference's own
    error, plus half a bf16 step at the tensor's scale: as accurate as PyTorch in the same dtype.
    """
    exact = _run(op, inputs, differentiable, KernelBackend.REFERENCE, torch.float32, 0)
    triton = _run(op, inputs, differentiable, KernelBackend.TRITON, dtype, 0)
    names = ["output"] + [f"grad of input {i}" for i in differentiable]
    if dtype == torch.float32:
        for name, t, e in zip(names, triton, exact, strict=True):
            scale = e.abs().max().clamp(min=1e-6).item()
            torch.testing.assert_close(t, e, rtol=fp32_tolerance, atol=fp32_tolerance * scale, msg=name)
        return
    reference = _run(op, inputs, differentiable, KernelBackend.REFERENCE, dtype, 0)
    for name, t, r, e in zip(names, triton, reference, exact, strict=True):
        scale = e.abs().max().clamp(min=1e-6).item()
        triton_error = (t - e).abs().max().item()
        reference_error = (r - e).abs().max().item()
        # fp32 rounding order differs between the paths: allow one bf16 half-step at the tensor's scale.
        assert triton_error <= bf16_slack * reference_error + 2**-8 * scale, (
            f"{name}: triton error {triton_error:.3g} vs bf16 reference error {reference_error:.3g} "
            f"(scale {scale:.3g})"
        )
