"""The one-pass float8 cast kernels against the reference quantization (``quantize_rowwise``).

On CPU the kernels run in Triton's interpreter, whose float32-to-float8 conversion does not round
as the GPU does (values near a binade's top round down a binade); so the CPU tests feed values that
become exactly representable once scaled (float8 data times a power of two per row or column), which
checks the maxima, the power-of-two scales, the joins, the layouts and the masks bit for bit. The
``gpu`` test compares the compiled kernels on random data, where rounding matters too.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

from d9d.parallel import quantize_rowwise

_FLOAT8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        # read when the kernels are decorated, i.e. at the module's first import (no CUDA: not yet)
        os.environ["TRITON_INTERPRET"] = "1"
    return importlib.import_module("d9d.parallel._float8_cast_kernels")


def _representable(shape: tuple[int, ...], dim: int, seed: int) -> torch.Tensor:
    """bf16 values that are float8 e4m3 values times a power of two per slice along ``dim``."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    data = bits.view(_FLOAT8).float()
    data = torch.where(data.isfinite(), data, torch.zeros_like(data))
    other = [s for i, s in enumerate(shape) if i != dim]
    exponents = torch.randint(-12, 12, other, generator=generator).unsqueeze(dim)
    return (data * torch.exp2(exponents.float())).to(torch.bfloat16)


def test_row_cast_equals_the_reference_bit_for_bit(kernels: ModuleType) -> None:
    x = _representable((37, 96), dim=1, seed=0)  # a width that is not a power of two
    x[5] = 0.0  # an all-zero row gets the reference's finite scale
    x[7, 3] = 448 * 2.0**-20  # a row whose maximum is tiny
    got = kernels.cast_rows((x,))
    want = quantize_rowwise(x, dim=1)
    assert got[1].shape == (37, 1)
    assert torch.equal(got[0].float(), want[0].float())
    assert torch.equal(got[1], want[1])


def test_row_cast_of_strided_rows_and_of_no_rows(kernels: ModuleType) -> None:
    wide = _representable((9, 80), dim=1, seed=1)
    x = wide[:, 8:72]  # rows with a stride wider than the row
    got = kernels.cast_rows((x,))
    want = quantize_rowwise(x, dim=1)
    assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    empty = kernels.cast_rows((torch.empty(0, 64, dtype=torch.bfloat16),))
    assert empty[0].shape == (0, 64) and empty[1].shape == (0, 1)


def test_joined_rows_share_one_scale_per_row(kernels: ModuleType) -> None:
    a, b = _representable((21, 128), dim=1, seed=2).split([48, 80], dim=1)  # one power of two per row
    got = kernels.cast_rows((a, b))
    want = quantize_rowwise(torch.cat([a, b], dim=1), dim=1)
    assert got[0].shape == (21, 128)
    assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="one or two parts, got 3"):
        kernels.cast_rows((a, a, a))


def test_weight_rows_join_along_the_output_dim(kernels: ModuleType) -> None:
    weight_a, weight_b = _representable((3, 40, 80), dim=2, seed=4).split([32, 48], dim=2)
    data, inverse = kernels.cast_weight_rows((weight_a, weight_b))
    want_data, want_inverse = quantize_rowwise(torch.cat([weight_a, weight_b], dim=2), dim=2)
    assert data.shape == (3, 40, 80) and inverse.shape == (3, 40, 1)
    assert torch.equal(data.float(), want_data.float()) and torch.equal(inverse, want_inverse)


@pytest.mark.parametrize("shape", [(3, 70, 96), (2, 128, 64), (1, 16, 130)])
def test_weight_columns_are_column_major_with_one_scale_per_column(
    kernels: ModuleType, shape: tuple[int, int, int]
) -> None:
    weight = _representable(shape, dim=1, seed=6)  # one power of two per (group, column)
    data, inverse = kernels.cast_weight_columns(weight)
    want_data, want_inverse = quantize_rowwise(weight.transpose(1, 2), dim=2)
    groups, rows, columns = shape
    assert data.shape == shape and data.stride() == (rows * columns, 1, rows), "column-major per group"
    assert inverse.shape == (groups, 1, columns)
    assert torch.equal(data.float(), want_data.transpose(1, 2).float())
    assert torch.equal(inverse, want_inverse.transpose(1, 2))


def test_scales_come_from_the_maximum_bits_at_every_binade_edge(kernels: ModuleType) -> None:
    # maxima around 448 * 2**k, where a rounded logarithm could be off by one binade
    maxima = torch.tensor(
        [448.0, 447.0, 449.0, 224.0, 1.75, 1.0, 2.0, 1e-12, 3.0e38, 7.0], dtype=torch.float32
    )
    x = torch.zeros(len(maxima), 16)
    x[:, 0] = maxima
    x = x.to(torch.bfloat16)
    got = kernels.cast_rows((x,))
    want = quantize_rowwise(x, dim=1)
    assert torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernels_round_as_the_reference(kernels: ModuleType) -> None:
    torch.manual_seed(0)
    x = (torch.randn(1000, 2048, device="cuda") * torch.logspace(-4, 4, 1000, device="cuda")[:, None]).to(
        torch.bfloat16
    )
    got, want = kernels.cast_rows((x,)), quantize_rowwise(x, dim=1)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    grads = [torch.randn(1000, 768, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    got = kernels.cast_rows(grads)
    want = quantize_rowwise(torch.cat(grads, dim=1), dim=1)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    weight = torch.randn(8, 2048, 768, device="cuda", dtype=torch.bfloat16)
    data, inverse = kernels.cast_weight_columns(weight)
    want_data, want_inverse = quantize_rowwise(weight.transpose(1, 2), dim=2)
    assert torch.equal(data.transpose(1, 2).view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(inverse, want_inverse.transpose(1, 2))
