"""RMSNorm's tiled kernels at widths and row counts around the tile shape, against the reference.

A tile is ROWS x BLOCK (BLOCK = the row width padded to a power of two, ROWS about 4096 / BLOCK);
the backward deals tiles round-robin to persistent programs (8 in the CPU interpreter).
"""

import pytest
import torch

from d9d.kernels import KernelBackend, rms_norm

from ._compare import DEVICES, DTYPES, assert_matches_reference


def _randn(*shape: int, device: str) -> torch.Tensor:
    return torch.randn(*shape, device=device, generator=torch.Generator(device=device).manual_seed(0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("hidden", "cpu_rows", "gpu_rows", "zero_centered"),
    [
        pytest.param(128, 300, 16384 * 16 + 5, False, id="qk-norm-128"),  # 32-row tiles, several per program
        pytest.param(1024, 37, 16384 + 3, False, id="hidden-1024"),  # 4-row tiles, a partial last tile
        pytest.param(96, 70, 50001, True, id="odd-96"),  # padded to 128 columns
        pytest.param(1000, 37, 20001, True, id="odd-1000"),  # padded to 1024 columns
        pytest.param(1152, 9, 16384 + 3, True, id="gemma-1152"),  # 2048 columns, 8 programs an SM
        pytest.param(128, 1, 1, False, id="one-row"),  # one tile, one program, 31 masked rows
    ],
)
def test_rms_norm_tiles(
    device: str, dtype: torch.dtype, hidden: int, cpu_rows: int, gpu_rows: int, zero_centered: bool
) -> None:
    rows = cpu_rows if device == "cpu" else gpu_rows
    x = _randn(rows, hidden, device=device) * 3
    weight = _randn(hidden, device=device) * 0.1 + (0.0 if zero_centered else 1.0)
    assert_matches_reference(
        lambda x, w, backend: rms_norm(x, w, 1e-6, zero_centered_weight=zero_centered, backend=backend),
        [x, weight], [0, 1], dtype,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rows_per_tile", "programs_per_sm"),
    [
        (1, 4),  # one row per program, as before tiling
        (8, 1),  # fewer persistent programs, more tiles each
        (64, 16),  # the largest tile, more programs than tiles
    ],
)
def test_rms_norm_tile_overrides_match_default(device: str, rows_per_tile: int, programs_per_sm: int) -> None:
    # The benchmark sweeps these launch settings; every setting must compute the same thing.
    from d9d.kernels._triton.rms_norm_kernels import rms_norm_backward, rms_norm_forward

    x, dy = _randn(2, 45, 128, device=device), _randn(2, 45, 128, device=device).flip(0)
    weight = _randn(128, device=device)
    y, rstd = rms_norm_forward(x, weight, 1e-6, False)
    y_tiled, rstd_tiled = rms_norm_forward(x, weight, 1e-6, False, rows_per_tile=rows_per_tile)
    dx, dw = rms_norm_backward(dy, x, weight, rstd, False)
    dx_tiled, dw_tiled = rms_norm_backward(
        dy, x, weight, rstd, False, rows_per_tile=rows_per_tile, programs_per_sm=programs_per_sm
    )
    for got, expected in ((y_tiled, y), (rstd_tiled, rstd), (dx_tiled, dx), (dw_tiled, dw)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_no_rows(device: str) -> None:
    x = torch.empty(0, 3, 128, device=device, requires_grad=True)
    weight = torch.ones(128, device=device, requires_grad=True)
    y = rms_norm(x, weight, backend=KernelBackend.TRITON)
    y.sum().backward()
    assert y.shape == (0, 3, 128)
    assert x.grad is not None and x.grad.shape == x.shape
    assert weight.grad is not None and torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("count", "programs", "columns"),
    [
        (1, 300, 1152),  # more partials than one strip's rows, columns not a multiple of the strip
        (2, 7, 33),  # both weights of rms_norm_add, fewer partials than one strip's rows
    ],
)
def test_sum_partials(device: str, count: int, programs: int, columns: int) -> None:
    from d9d.kernels._triton.rms_norm_kernels import sum_partials

    partials = _randn(count, programs, columns, device=device)
    dtypes = (torch.bfloat16, torch.float32)[:count]
    sums = sum_partials(partials, dtypes)
    assert [s.dtype for s in sums] == list(dtypes)
    for got, expected in zip(sums, partials.double().sum(dim=1), strict=True):
        torch.testing.assert_close(got.double(), expected.to(got.dtype).double(), rtol=1e-2, atol=1e-4)
    again = sum_partials(partials, dtypes)
    assert all(torch.equal(a, b) for a, b in zip(sums, again, strict=True)), "a fixed summation order"
    with pytest.raises(ValueError, match="3 slices of partials"):
        sum_partials(partials.new_zeros(3, 2, 2), (torch.float32,) * 3)
