"""RMSNorm variants."""

import torch

from d9d.kernels.layers import RMSNorm


def test_zero_centered_rms_norm_scales_by_one_plus_weight() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(8, zero_centered_weight=True)
    with torch.no_grad():
        norm.weight.normal_()
    plain = RMSNorm(8)
    with torch.no_grad():
        plain.weight.copy_(1 + norm.weight)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), plain(x))
