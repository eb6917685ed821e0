"""Attention backends agree with the eager reference; backend selection rules."""

import importlib
import math

import pytest
import torch

from d9d.kernels.layers import (
    ATTENTION_BACKEND_ENV_VAR,
    FLASH_ATTENTION_2_EXTRA,
    FLASH_ATTENTION_4_EXTRA,
    AttentionBackend,
    AttentionBackendUnavailableError,
    EagerAttentionBackend,
    FlashAttention2Backend,
    FlashAttention4Backend,
    FlexAttentionBackend,
    SdpaAttentionBackend,
    build_attention_backend,
    build_attention_mask,
    select_attention_backend,
)

DOCUMENTS = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])


def _available_backends(device: torch.device) -> list[AttentionBackend]:
    backends: list[AttentionBackend] = [SdpaAttentionBackend(), FlexAttentionBackend()]
    if device.type == "cuda":
        # windows and packed documents on FlexAttention's own kernel, off PyTorch's varlen path
        backends.append(FlexAttentionBackend(torch_flash=False))
        for name in ("flash_attention_2", "flash_attention_4"):
            try:
                backends.append(build_attention_backend(name))
            except AttentionBackendUnavailableError:
                continue
    return backends


def _naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """Loops over every query: the definition, for checking the mask logic independently."""
    batch, seq, heads, _ = q.shape
    group = heads // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                keys = allowed[b, i].nonzero().reshape(-1)
                scores = k[b, keys, h // group] @ q[b, i, h] / math.sqrt(q.shape[-1])
                out[b, i, h] = torch.softmax(scores, dim=0) @ v[b, keys, h // group]
    return out


# (causal, sliding_window, packed documents)
MASK_CASES = [
    (True, None, False),  # causal
    (False, None, False),  # bidirectional
    (True, 3, False),  # causal sliding window
    (False, 3, False),  # symmetric sliding window
    (True, None, True),  # causal packed documents
    (False, None, True),  # bidirectional packed documents
    (True, 2, True),  # everything
]


@pytest.mark.parametrize(("causal", "window", "packed"), MASK_CASES)
def test_eager_matches_definition(causal: bool, window: int | None, packed: bool) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 12, 4, 8, dtype=torch.float64)
    k = torch.randn(2, 12, 2, 8, dtype=torch.float64)
    v = torch.randn(2, 12, 2, 8, dtype=torch.float64)
    documents = DOCUMENTS if packed else None
    out = EagerAttentionBackend().attend(
        q, k, v, causal=causal, softmax_scale=8**-0.5, sliding_window=window, document_ids=documents
    )
    i = torch.arange(12)[:, None]
    j = torch.arange(12)[None, :]
    allowed = torch.ones(2, 12, 12, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= (i - j < window) & ((j - i < window) | causal)
    if documents is not None:
        allowed &= documents[:, :, None] == documents[:, None, :]
    torch.testing.assert_close(out, _naive_attention(q, k, v, allowed))


@pytest.mark.parametrize(
    ("causal", "expected"),
    [
        # causal window of 2: the query and the token before it (i - 2 < j <= i)
        (True, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]),
        # two-sided window of 2: one token on each side (|i - j| < 2)
        (False, [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]),
    ],
)
def test_mask_has_documented_shape_and_meaning(causal: bool, expected: list[list[int]]) -> None:
    mask = build_attention_mask(4, causal=causal, sliding_window=2)
    torch.testing.assert_close(mask, torch.tensor(expected, dtype=torch.bool)[None, None])


# (q_heads, kv_heads): MHA, GQA, MQA
HEAD_CASES = [(4, 4), (4, 2), (4, 1)]


@pytest.mark.parametrize(("q_heads", "kv_heads"), HEAD_CASES)
@pytest.mark.parametrize(("causal", "window", "packed"), MASK_CASES)
def test_backends_agree_with_eager_forward_and_backward(
    q_heads: int, kv_heads: int, causal: bool, window: int | None, packed: bool
) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.manual_seed(0)
    q = torch.randn(2, 12, q_heads, 64, device=device, dtype=dtype)
    k = torch.randn(2, 12, kv_heads, 64, device=device, dtype=dtype)
    v = torch.randn(2, 12, kv_heads, 64, device=device, dtype=dtype)
    upstream = torch.randn(2, 12, q_heads, 64, device=device, dtype=dtype)
    documents = DOCUMENTS.to(device) if packed else None

    def run(backend: AttentionBackend) -> tuple[torch.Tensor, ...]:
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = backend.attend(
            *inputs, causal=causal, softmax_scale=0.125, sliding_window=window, document_ids=documents
        )
        (out.float() * upstream.float()).sum().backward()
        return (out, *(t.grad for t in inputs if t.grad is not None))

    reference = run(EagerAttentionBackend())
    for backend in _available_backends(device):
        for got, expected in zip(run(backend), reference, strict=True):
            torch.testing.assert_close(got, expected, **tolerance, msg=lambda m, b=backend: f"{type(b)}: {m}")


@pytest.mark.parametrize(("q_heads", "kv_heads"), HEAD_CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 200])
def test_flex_window_block_mask_equals_eager_at_lengths_off_its_block_size(
    q_heads: int, kv_heads: int, causal: bool, window: int
) -> None:
    # 130 tokens: one full 128-token block and a partial one; CPU runs the forward (no backward
    # there), a GPU also runs the backward in test_backends_agree_with_eager_forward_and_backward
    torch.manual_seed(0)
    q = torch.randn(2, 130, q_heads, 16)
    k = torch.randn(2, 130, kv_heads, 16)
    v = torch.randn(2, 130, kv_heads, 16)
    options = {"causal": causal, "softmax_scale": 0.25, "sliding_window": window}
    got = FlexAttentionBackend().attend(q, k, v, **options)
    expected = EagerAttentionBackend().attend(q, k, v, **options)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packed_attention_equals_attention_per_document() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 8) for _ in range(3))
    documents = DOCUMENTS[:1]
    packed = SdpaAttentionBackend().attend(q, k, v, causal=True, softmax_scale=0.3, document_ids=documents)
    for start, end in ((0, 5), (5, 8), (8, 12)):
        alone = SdpaAttentionBackend().attend(
            q[:, start:end], k[:, start:end], v[:, start:end], causal=True, softmax_scale=0.3
        )
        torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-5, atol=1e-6)


def test_explicit_name_wins_over_environment() -> None:
    backend = select_attention_backend("eager", environ={ATTENTION_BACKEND_ENV_VAR: "sdpa"})
    assert isinstance(backend, EagerAttentionBackend)


def test_environment_wins_over_detection() -> None:
    backend = select_attention_backend(environ={ATTENTION_BACKEND_ENV_VAR: "eager"})
    assert isinstance(backend, EagerAttentionBackend)


def test_detection_without_gpu_or_extras_is_sdpa() -> None:
    if torch.cuda.is_available():
        pytest.skip("detection on a GPU depends on the installed extras")
    assert isinstance(select_attention_backend(environ={}), SdpaAttentionBackend)


def test_unknown_environment_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=f"{ATTENTION_BACKEND_ENV_VAR}='flash'"):
        select_attention_backend(environ={ATTENTION_BACKEND_ENV_VAR: "flash"})


# (backend class, extra it needs)
FLASH_CASES = [
    (FlashAttention2Backend, FLASH_ATTENTION_2_EXTRA),
    (FlashAttention4Backend, FLASH_ATTENTION_4_EXTRA),
]


@pytest.mark.parametrize(("backend_class", "extra"), FLASH_CASES)
def test_missing_flash_attention_extra_is_named(backend_class: type, extra: str) -> None:
    module = "flash_attn.cute" if backend_class is FlashAttention4Backend else "flash_attn"
    try:
        importlib.import_module(module).flash_attn_varlen_func  # noqa: B018
    except (ImportError, AttributeError):
        pass
    else:
        pytest.skip(f"{extra} is installed here")
    assert extra.startswith("backend-sdpa-flash-attention-")
    with pytest.raises(AttentionBackendUnavailableError, match=extra):
        backend_class()
