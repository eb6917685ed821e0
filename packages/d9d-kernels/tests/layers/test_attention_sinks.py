"""Attention sinks: eager, SDPA and FlexAttention against a plain-PyTorch reference and transformers'
GPT-OSS attention."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from d9d.kernels.layers import (
    ATTENTION_BACKEND_ENV_VAR,
    EagerAttentionBackend,
    FlexAttentionBackend,
    GroupedQueryAttention,
    RotaryEmbedding,
    SdpaAttentionBackend,
    SinkAttentionBackend,
    detect_attention_backend,
    select_attention_backend,
)
from d9d.kernels.layers._flex_attention import rescale_for_sinks


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Causal attention with one sink logit per head, written out in float64 (``(b, s, h, d)``)."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(q.shape[2])[None, :]
    allowed = (j <= i) & (i - j < window if window is not None else True)
    exp = torch.exp(scores.masked_fill(~allowed, float("-inf")))
    denominator = exp.sum(-1, keepdim=True) + torch.exp(sinks.double()).view(1, -1, 1, 1)
    return ((exp / denominator) @ v).transpose(1, 2)


@pytest.mark.parametrize("backend", [EagerAttentionBackend(), SdpaAttentionBackend()], ids=["eager", "sdpa"])
@pytest.mark.parametrize("window", [None, 3])
def test_backends_attend_with_sinks_as_the_reference(
    backend: SinkAttentionBackend, window: int | None
) -> None:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 8, generator=generator, requires_grad=True)
    k = torch.randn(2, 7, 2, 8, generator=generator, requires_grad=True)
    v = torch.randn(2, 7, 2, 8, generator=generator, requires_grad=True)
    sinks = torch.tensor([3.0, -2.0, 0.0, 1.5], requires_grad=True)
    out = backend.attend_with_sinks(
        q, k, v, sinks=sinks, causal=True, softmax_scale=8**-0.5, sliding_window=window
    )
    expected = _reference(q, k, v, sinks, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    weight = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * weight).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((expected * weight).sum(), (q, k, v, sinks))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[3].abs().min() > 0  # every sink gets a gradient


@pytest.mark.parametrize("window", [None, 1, 3, 200])
def test_flex_attends_with_sinks_as_the_reference_off_its_block_size(window: int | None) -> None:
    # 130 tokens: a full 128-token block and a partial one; forward only on CPU (flex has no CPU
    # backward), the GPU test below also checks gradients
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 130, 4, 8, generator=generator)
    k = torch.randn(2, 130, 2, 8, generator=generator)
    v = torch.randn(2, 130, 2, 8, generator=generator)
    sinks = torch.tensor([3.0, -2.0, 0.0, 1.5])
    out = FlexAttentionBackend().attend_with_sinks(
        q, k, v, sinks=sinks, causal=True, softmax_scale=8**-0.5, sliding_window=window
    )
    torch.testing.assert_close(out.double(), _reference(q, k, v, sinks, window), atol=1e-5, rtol=1e-5)


def test_flex_full_attention_with_sinks_equals_sdpa_and_eager_without_a_block_mask() -> None:
    # neither causal nor windowed: flex gets block_mask=None and builds (and caches) no mask; forward
    # only on CPU, over a full 128-token block and a partial one
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 130, 4, 8, generator=generator)
    k = torch.randn(2, 130, 2, 8, generator=generator)
    v = torch.randn(2, 130, 2, 8, generator=generator)
    sinks = torch.tensor([3.0, -2.0, 0.0, 1.5])
    flex = FlexAttentionBackend()
    out = flex.attend_with_sinks(q, k, v, sinks=sinks, causal=False, softmax_scale=8**-0.5)
    assert flex._block_masks == {}  # pyright: ignore[reportPrivateUsage]
    for backend in (SdpaAttentionBackend(), EagerAttentionBackend()):
        expected = backend.attend_with_sinks(q, k, v, sinks=sinks, causal=False, softmax_scale=8**-0.5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # a masked call still builds its block mask once and keeps it
    flex.attend_with_sinks(q, k, v, sinks=sinks, causal=True, softmax_scale=8**-0.5)
    flex.attend_with_sinks(q, k, v, sinks=sinks, causal=True, softmax_scale=8**-0.5)
    assert list(flex._block_masks) == [(130, True, None, "cpu")]  # pyright: ignore[reportPrivateUsage]


@pytest.mark.parametrize("window", [None, 3])
def test_sink_rescaling_of_attention_and_its_lse_gives_the_reference_gradients(window: int | None) -> None:
    # what FlexAttentionBackend does after the kernel, on a differentiable plain attention and lse
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 7, 4, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 7, 2, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 7, 2, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([3.0, -2.0, 0.0, 1.5], dtype=torch.float64, requires_grad=True)
    heads_q = q.transpose(1, 2)
    heads_k, heads_v = (t.transpose(1, 2).repeat_interleave(2, dim=1) for t in (k, v))
    scores = heads_q @ heads_k.transpose(-1, -2) * 8**-0.5
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    allowed = (j <= i) & (i - j < window if window is not None else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    plain = (torch.softmax(scores, -1) @ heads_v).transpose(1, 2)
    out = rescale_for_sinks(plain, torch.logsumexp(scores, -1), sinks)
    expected = _reference(q, k, v, sinks, window)
    torch.testing.assert_close(out, expected)
    weight = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad((out * weight).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((expected * weight).sum(), (q, k, v, sinks))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def _packed_rows(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    """Two rows of documents of ``lengths`` (ids 0, 1, ...), the second in reverse order."""
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return torch.stack([row, row.flip(0)]).to(device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("causal", "window", "lengths"),
    [
        (True, None, None),
        (True, 128, None),
        (False, None, None),
        (True, None, [40, 130, 1, 129]),
        (True, 128, [40, 130, 1, 129]),
        (False, None, [299, 1]),
    ],
)
def test_flex_with_sinks_forward_and_backward_equal_eager_on_the_gpu(
    causal: bool, window: int | None, lengths: list[int] | None
) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (2, 300, 8, 64), (2, 300, 2, 64)
    q = torch.randn(shape_q, generator=generator, device="cuda", requires_grad=True)
    k = torch.randn(shape_kv, generator=generator, device="cuda", requires_grad=True)
    v = torch.randn(shape_kv, generator=generator, device="cuda", requires_grad=True)
    sinks = torch.randn(8, generator=generator, device="cuda", requires_grad=True)
    documents = None if lengths is None else _packed_rows(lengths, "cuda")
    options = {"causal": causal, "softmax_scale": 0.125, "sliding_window": window, "document_ids": documents}
    outs = [
        backend.attend_with_sinks(q, k, v, sinks=sinks, **options)
        for backend in (FlexAttentionBackend(), EagerAttentionBackend())
    ]
    weight = torch.randn(outs[0].shape, generator=generator, device="cuda")
    grads = [torch.autograd.grad((out * weight).sum(), (q, k, v, sinks)) for out in outs]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=2e-3)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_with_sinks_on_packed_batches_of_changing_layouts_equals_eager() -> None:
    """GPT-OSS packed training: each batch brings other documents, through one compiled backend."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    flex = FlexAttentionBackend()
    compiled = torch.compile(flex.attend_with_sinks)
    sinks = torch.randn(8, generator=generator, device="cuda", requires_grad=True)
    for lengths in ([100, 312, 311, 301], [100, 312, 311, 301], [1000, 24], [7, 513, 200, 150, 154]):
        inputs = [torch.randn(2, 1024, heads, 64, generator=generator, device="cuda") for heads in (8, 2, 2)]
        documents = _packed_rows(lengths, "cuda")
        weight = torch.randn(2, 1024, 8, 64, generator=generator, device="cuda")
        runs = (
            (compiled, torch.bfloat16),
            (SdpaAttentionBackend().attend_with_sinks, torch.bfloat16),
            (EagerAttentionBackend().attend_with_sinks, torch.float32),
        )
        results: list[list[torch.Tensor]] = []
        for attend, dtype in runs:
            q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs)
            out = attend(
                q,
                k,
                v,
                sinks=sinks,
                causal=True,
                softmax_scale=0.125,
                sliding_window=128,
                document_ids=documents,
            )
            grads = torch.autograd.grad((out.float() * weight).sum(), (q, k, v, sinks))
            results.append([t.float() for t in (out, *grads)])
        got, sdpa, reference = results
        for label, g, s, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, sdpa, reference, strict=True):
            # within twice SDPA's bf16 error plus half a bf16 step of the largest value
            error, sdpa_error = (g - r).abs().max().item(), (s - r).abs().max().item()
            bound = 2 * sdpa_error + 2**-9 * r.abs().max().item()
            assert error <= bound, f"{lengths} {label}: error {error:.3g}, SDPA bf16 {sdpa_error:.3g}"
    # one mask kind seen (causal, window 128): one memo, a mask per recent document_ids tensor
    assert list(flex._document_masks) == [(True, 128, "cuda:0")]  # pyright: ignore[reportPrivateUsage]


@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, 3), (False, None), (False, 5)])
def test_flex_with_sinks_on_packed_documents_equals_sdpa_and_builds_the_mask_once(
    causal: bool, window: int | None
) -> None:
    # forward only (flex has no CPU backward); the second row's id 2 comes back after id 3, and
    # both backends join its two runs into one document
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 140, 4, 8, generator=generator)
    k = torch.randn(2, 140, 2, 8, generator=generator)
    v = torch.randn(2, 140, 2, 8, generator=generator)
    sinks = torch.tensor([3.0, -2.0, 0.0, 1.5])
    documents = torch.stack([_packed_rows([30, 1, 109])[0], torch.tensor([2] * 50 + [3] * 40 + [2] * 50)])
    options = {
        "causal": causal,
        "softmax_scale": 8**-0.5,
        "sliding_window": window,
        "document_ids": documents,
    }
    flex = FlexAttentionBackend()
    out = flex.attend_with_sinks(q, k, v, sinks=sinks, **options)
    expected = SdpaAttentionBackend().attend_with_sinks(q, k, v, sinks=sinks, **options)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    block_mask = flex._document_block_mask(documents, causal=causal, sliding_window=window)  # pyright: ignore[reportPrivateUsage]
    assert flex._document_block_mask(documents, causal=causal, sliding_window=window) is block_mask  # pyright: ignore[reportPrivateUsage]
    documents[0, -1] = 7  # a refilled input buffer gets a new mask
    assert flex._document_block_mask(documents, causal=causal, sliding_window=window) is not block_mask  # pyright: ignore[reportPrivateUsage]


def test_flex_document_masks_of_alternating_microbatches_are_built_once_each_and_hold_no_ids() -> None:
    flex = FlexAttentionBackend()
    first = _packed_rows([30, 1, 109])
    second = _packed_rows([70, 70])
    masks = [flex._document_block_mask(ids, causal=True, sliding_window=None) for ids in (first, second)]  # pyright: ignore[reportPrivateUsage]
    # microbatch 1's backward recompute after microbatch 2's forward finds its mask again
    for ids, mask in zip((first, second, first), (*masks, masks[0]), strict=True):
        assert flex._document_block_mask(ids, causal=True, sliding_window=None) is mask  # pyright: ignore[reportPrivateUsage]
    gone = weakref.ref(first)
    del first, ids
    gc.collect()
    assert gone() is None  # neither the memo nor the mask it keeps holds the caller's tensor
    assert len(flex._document_masks[(True, None, "cpu")]) == 1  # pyright: ignore[reportPrivateUsage]


def test_flex_refuses_document_ids_of_another_shape_naming_it() -> None:
    q = torch.randn(2, 10, 4, 8)
    k = v = torch.randn(2, 10, 2, 8)
    with pytest.raises(ValueError, match=r"document_ids must be \(2, 10\), got shape \(1, 10\)"):
        FlexAttentionBackend().attend_with_sinks(
            q, k, v, sinks=torch.zeros(4), causal=True, softmax_scale=1.0, document_ids=torch.zeros(1, 10)
        )


@pytest.mark.parametrize("backend", ["sdpa", "flex_attention"])
def test_sinks_with_packed_documents_equal_each_document_alone(backend: str) -> None:
    torch.manual_seed(0)
    layer = GroupedQueryAttention(32, 4, 2, sinks=True, sliding_window=4, attention_backend=backend)
    rotary = RotaryEmbedding(8)
    documents = [torch.randn(1, n, 32) for n in (5, 6)]
    ids = torch.tensor([[0] * 5 + [1] * 6])
    positions = torch.cat([torch.arange(5), torch.arange(6)]).unsqueeze(0)
    # flex_attention runs on a CPU for inference only (no backward there)
    with torch.no_grad():
        packed = layer(torch.cat(documents, dim=1), rotary(positions), document_ids=ids)
        alone = [layer(d, rotary(torch.arange(d.shape[1]).unsqueeze(0))) for d in documents]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), atol=1e-5, rtol=1e-5)


class _PlainBackend:
    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **_: object
    ) -> torch.Tensor:
        return query


def test_auto_detection_picks_a_backend_with_sinks() -> None:
    # never FlashAttention, even where it is installed: it has no sinks
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        assert detect_attention_backend(sinks=True) == "flex_attention"
        assert isinstance(select_attention_backend(environ={}, sinks=True), FlexAttentionBackend)
    else:
        assert detect_attention_backend(sinks=True) == "sdpa"
        assert isinstance(select_attention_backend(environ={}, sinks=True), SdpaAttentionBackend)
    chosen = select_attention_backend(environ={ATTENTION_BACKEND_ENV_VAR: "eager"}, sinks=True)
    assert isinstance(chosen, EagerAttentionBackend)  # an explicit choice is kept


def test_a_backend_without_sinks_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="_PlainBackend does not"):
        GroupedQueryAttention(32, 4, 2, sinks=True, attention_backend=_PlainBackend())
    layer = GroupedQueryAttention(32, 4, 2, sinks=True, attention_backend="eager")
    layer.attention_backend = _PlainBackend()  # as context parallelism would install its own
    with pytest.raises(ValueError, match="attention sinks need"):
        layer(torch.randn(1, 3, 32), RotaryEmbedding(8)(torch.arange(3).unsqueeze(0)))


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gqa_with_sinks_equals_transformers_gpt_oss_attention(layer_type: str) -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    config = GptOssConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=1,
        sliding_window=3,
        layer_types=[layer_type],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = GptOssAttention(config, layer_idx=0)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.normal_(std=0.3)
    window = 3 if layer_type == "sliding_attention" else None
    ours = GroupedQueryAttention(32, 4, 2, head_dim=8, bias=True, sinks=True, sliding_window=window)
    ours.load_state_dict(hf.state_dict())
    hidden = torch.randn(2, 6, 32)
    positions = torch.arange(6).expand(2, 6)
    i, j = positions[0][:, None], positions[0][None, :]
    allowed = (j <= i) & (i - j < window if window is not None else True)
    mask = torch.zeros(1, 1, 6, 6).masked_fill(~allowed, float("-inf"))
    expected, _ = hf(hidden, GptOssRotaryEmbedding(config)(hidden, positions), attention_mask=mask)
    got = ours(hidden, RotaryEmbedding(8, theta=10000.0)(positions))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
