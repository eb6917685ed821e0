"""Routing to PyTorch's FlashAttention kernels, on a CPU (the kernels: test_flash_attention_gpu.py)."""

import pytest
import torch

from d9d.kernels.layers import build_attention_mask
from d9d.kernels.layers._torch_flash_attention import TorchFlashAttention, flash_window


def _window_mask(seq: int, window: tuple[int, int]) -> torch.Tensor:
    """FlashAttention's ``(left, right)``: query i sees key j when i - left <= j <= i + right."""
    left, right = window
    query = torch.arange(seq).view(-1, 1)
    key = torch.arange(seq).view(1, -1)
    after_left = key >= query - left if left >= 0 else torch.ones(seq, seq, dtype=torch.bool)
    before_right = key <= query + right if right >= 0 else torch.ones(seq, seq, dtype=torch.bool)
    return after_left & before_right


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 1, 2, 5, 40])
def test_flash_window_means_the_backends_mask(causal: bool, sliding_window: int | None) -> None:
    seq = 13
    expected = build_attention_mask(seq, causal=causal, sliding_window=sliding_window)
    if expected is None:  # full attention: no mask
        expected = torch.ones(1, 1, seq, seq, dtype=torch.bool)
    got = _window_mask(seq, flash_window(causal=causal, sliding_window=sliding_window))
    torch.testing.assert_close(got, expected.reshape(seq, seq))


def test_cpu_inputs_do_not_run_on_flash_kernels() -> None:
    q, k, v = (torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    assert not TorchFlashAttention().runs(q, k, v)
