"""FlashAttention 4's custom ops, on CPU over a stand-in ``flash_attn.cute.interface``.

The stand-in's launchers compute attention in float32 the way the package's return them (output,
log-sum-exp ``(batch, heads, seq)``; ``(dq, dk, dv)``), so the tests check the ops' wiring: the
values and gradients, their fake shapes under ``torch.compile`` in one graph, and the fallback when
the launchers are missing. The kernels themselves run in ``test_flash_attention_gpu.py``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from d9d.kernels.layers._eager_attention import EagerAttentionBackend
from d9d.kernels.layers._flash_attention_4_ops import flash_attention_4, launchers_available


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, left: int | None) -> torch.Tensor:
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    seq = q.shape[1]
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    allowed = torch.ones(seq, seq, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if left is not None:
        allowed &= i - j <= left
    return scores.masked_fill(~allowed, float("-inf"))


def _fake_fwd(q, k, v, *, softmax_scale, causal, window_size_left, window_size_right, return_lse):
    assert return_lse and window_size_right in (None, 0)
    scores = _scores(q, k, softmax_scale, causal, window_size_left)
    group = q.shape[2] // k.shape[2]
    probs = scores.softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(group, dim=2).float())
    return out.to(q.dtype), scores.logsumexp(-1), None, None, None


def _fake_bwd(
    q, k, v, out, dout, lse, softmax_scale, causal, softcap, *, window_size_left, window_size_right
):
    assert softcap == 0.0 and window_size_right in (None, 0)
    # the op's body runs below autograd: the gradients by hand, float32, heads repeated then summed
    group = q.shape[2] // k.shape[2]
    probs = (_scores(q, k, softmax_scale, causal, window_size_left) - lse[..., None]).exp()
    k_rep, v_rep = (t.repeat_interleave(group, dim=2).float() for t in (k, v))
    d_out = dout.float()
    d_probs = torch.einsum("bqhd,bkhd->bhqk", d_out, v_rep)
    delta = (d_out * out.float()).sum(-1).transpose(1, 2)[..., None]
    d_scores = probs * (d_probs - delta) * softmax_scale
    dq = torch.einsum("bhqk,bkhd->bqhd", d_scores, k_rep)
    dk = torch.einsum("bhqk,bqhd->bkhd", d_scores, q.float())
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, d_out)
    dk, dv = (t.unflatten(2, (k.shape[2], group)).sum(3) for t in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = _fake_fwd  # type: ignore[attr-defined]
    interface._flash_attn_bwd = _fake_bwd  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    return interface


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 24, 4, 16, generator=generator)
    k = torch.randn(2, 24, 1, 16, generator=generator)
    v = torch.randn(2, 24, 1, 16, generator=generator)
    return q, k, v


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_values_and_gradients_equal_eager_attention(
    stand_in: types.ModuleType, window: int | None, compiled: bool
) -> None:
    q, k, v = _inputs()
    upstream = torch.randn(2, 24, 4, 16, generator=torch.Generator().manual_seed(1))
    scale = 16**-0.5
    left = None if window is None else window - 1

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash_attention_4(
            q, k, v, softmax_scale=scale, causal=True, window=(left, None if left is None else 0)
        )

    run = torch.compile(attend, backend="aot_eager", fullgraph=True) if compiled else attend
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*leaves)
    out.backward(upstream)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = EagerAttentionBackend().attend(
        *ref_leaves, causal=True, softmax_scale=scale, sliding_window=window
    )
    expected.backward(upstream)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_launchers_available_follows_the_interface(
    stand_in: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert launchers_available()
    monkeypatch.delattr(stand_in, "_flash_attn_bwd")
    assert not launchers_available()
