"""FlashAttention 2 and 4 on a GPU at Qwen3-0.6B attention shapes, forward and gradients.

Each backend runs in bf16 and is compared with d9d's eager backend in fp32 on the same bf16 inputs.
A bf16 result cannot be exact, so the bar is SDPA's: the FlashAttention error may be at most twice
SDPA's own bf16 error plus half a bf16 step at the tensor's scale. A backend whose extra is not
installed skips, so does everything without a CUDA GPU.
"""

import pytest
import torch

from d9d.kernels.layers import (
    AttentionBackend,
    AttentionBackendName,
    AttentionBackendUnavailableError,
    EagerAttentionBackend,
    FlexAttentionBackend,
    SdpaAttentionBackend,
    build_attention_backend,
)
from d9d.kernels.layers._torch_flash_attention import TorchFlashAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

Q_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B: GQA, two query heads per key head
WINDOW = 200  # not a multiple of any kernel tile
HALF_BF16_STEP = 2.0**-8  # relative to the tensor's largest value, as in tests/_compare.py
SLACK = 2.0

FLASH_BACKENDS: list[AttentionBackendName] = ["flash_attention_2", "flash_attention_4"]

# (causal, sliding window, packed documents, batch, seq)
CASES = [
    pytest.param(True, None, False, 2, 1024, id="causal"),
    pytest.param(False, None, False, 2, 1024, id="bidirectional"),
    pytest.param(True, WINDOW, False, 2, 1024, id="causal-window"),
    pytest.param(False, WINDOW, False, 2, 1024, id="two-sided-window"),
    pytest.param(True, None, True, 2, 1024, id="causal-packed"),
    pytest.param(False, None, True, 2, 1024, id="bidirectional-packed"),
    pytest.param(True, WINDOW, True, 2, 1024, id="causal-window-packed"),
    pytest.param(True, None, False, 1, 4096, id="causal-long"),
    pytest.param(True, None, True, 1, 4096, id="causal-packed-long"),
]


def _flash_backend(name: AttentionBackendName) -> AttentionBackend:
    try:
        return build_attention_backend(name)
    except AttentionBackendUnavailableError as error:
        pytest.skip(str(error).split(" (")[0])


def _documents(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Uneven documents, none aligned to a tile; the last row is one document of the whole row."""
    lengths = torch.tensor([100, 312, 311, seq - 723])
    first = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    rows = [first] + [torch.zeros(seq, dtype=torch.int64)] * (batch - 1)
    return torch.stack(rows).to(device)


def _run(
    backend: AttentionBackend,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    upstream: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    documents: torch.Tensor | None,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Output and query/key/value gradients, in fp32; scores scaled by ``head_dim ** -0.5``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    scale = inputs[0].shape[-1] ** -0.5
    out = backend.attend(
        *leaves, causal=causal, softmax_scale=scale, sliding_window=window, document_ids=documents
    )
    grads = torch.autograd.grad(out, leaves, upstream.to(dtype))
    return [out.detach().float(), *(g.float() for g in grads)]


@pytest.mark.parametrize("name", FLASH_BACKENDS)
@pytest.mark.parametrize(("causal", "window", "packed", "batch", "seq"), CASES)
def test_flash_attention_matches_fp32_reference_like_sdpa(
    name: AttentionBackendName, causal: bool, window: int | None, packed: bool, batch: int, seq: int
) -> None:
    backend = _flash_backend(name)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def sample(heads: int) -> torch.Tensor:
        shape = (batch, seq, heads, HEAD_DIM)
        return torch.randn(shape, device=device, generator=generator).to(torch.bfloat16)

    inputs = (sample(Q_HEADS), sample(KV_HEADS), sample(KV_HEADS))
    upstream = sample(Q_HEADS)
    documents = _documents(batch, seq, device) if packed else None
    kw = {"causal": causal, "window": window, "documents": documents}

    reference = _run(EagerAttentionBackend(), inputs, upstream, **kw, dtype=torch.float32)
    sdpa = _run(SdpaAttentionBackend(), inputs, upstream, **kw, dtype=torch.bfloat16)
    flash = _run(backend, inputs, upstream, **kw, dtype=torch.bfloat16)

    for label, got, expected in zip(("out", "dq", "dk", "dv"), flash, reference, strict=True):
        assert got.shape == expected.shape
        assert bool(got.isfinite().all()), f"{label}: not finite"
    _assert_within_sdpa_bound(name, flash, sdpa, reference)


def _assert_within_sdpa_bound(
    name: str, got_all: list[torch.Tensor], sdpa: list[torch.Tensor], reference: list[torch.Tensor]
) -> None:
    """Output, dq, dk and dv each within twice SDPA's bf16 error plus half a bf16 step of fp32."""
    for label, got, bf16, expected in zip(("out", "dq", "dk", "dv"), got_all, sdpa, reference, strict=True):
        error = (got - expected).abs().max().item()
        sdpa_error = (bf16 - expected).abs().max().item()
        bound = SLACK * sdpa_error + HALF_BF16_STEP * expected.abs().max().item()
        message = f"{name} {label}: max error {error:.3g}, SDPA bf16 {sdpa_error:.3g}, bound {bound:.3g}"
        print(message)
        assert error <= bound, message


def test_flash_attention_4_names_an_unsupported_head_dim() -> None:
    backend = _flash_backend("flash_attention_4")
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10, 11):
        pytest.skip("head dim limits are checked on Hopper and Blackwell")
    q, k, v = (torch.zeros(1, 16, 2, 264, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="head_dim=264"):
        backend.attend(q, k, v, causal=True, softmax_scale=1.0)


# the flex_attention backend's cases for PyTorch's FlashAttention kernels: windows or packed documents
FLASH_MASK_CASES = [case for case in CASES if case.values[1] is not None or case.values[2]]


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"), [(16, 8, 128), (4, 1, 256)], ids=["qwen3", "gemma3"]
)
@pytest.mark.parametrize(("causal", "window", "packed", "batch", "seq"), FLASH_MASK_CASES)
def test_torch_flash_windows_and_documents_match_fp32_reference_like_sdpa(
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    causal: bool,
    window: int | None,
    packed: bool,
    batch: int,
    seq: int,
) -> None:
    """PyTorch's FlashAttention kernels, where the flex_attention backend sends windows and documents."""
    flash = TorchFlashAttention()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def sample(heads: int) -> torch.Tensor:
        shape = (batch, seq, heads, head_dim)
        return torch.randn(shape, device=device, generator=generator).to(torch.bfloat16)

    inputs = (sample(q_heads), sample(kv_heads), sample(kv_heads))
    if not flash.runs(*(t.requires_grad_() for t in inputs)):
        pytest.skip("this torch or GPU has no FlashAttention kernel for these inputs")
    upstream = sample(q_heads)
    documents = _documents(batch, seq, device) if packed else None
    kw = {"causal": causal, "window": window, "documents": documents}

    reference = _run(EagerAttentionBackend(), inputs, upstream, **kw, dtype=torch.float32)
    sdpa = _run(SdpaAttentionBackend(), inputs, upstream, **kw, dtype=torch.bfloat16)
    for name, backend in (
        ("torch_flash", flash),
        ("flex_attention", build_attention_backend("flex_attention")),
    ):
        _assert_within_sdpa_bound(
            name, _run(backend, inputs, upstream, **kw, dtype=torch.bfloat16), sdpa, reference
        )


class _Compiled:
    """A backend whose ``attend`` runs under ``torch.compile``, as inside a compiled decoder layer."""

    def __init__(self, backend: AttentionBackend, *, fullgraph: bool = False) -> None:
        self.attend = torch.compile(backend.attend, fullgraph=fullgraph)


@pytest.mark.parametrize("torch_flash", [True, False], ids=["varlen", "flex-kernel"])
def test_flex_backend_packed_documents_under_compile_match_fp32_reference_like_sdpa(
    torch_flash: bool,
) -> None:
    """Packed documents reach the varlen kernel through a compiled graph (its host syncs break it),
    or FlexAttention's kernel with a document block mask, batch after batch with other document
    counts and lengths, as a training loop feeds them."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    batch, seq = 2, 1024

    def sample(heads: int) -> torch.Tensor:
        return torch.randn(batch, seq, heads, HEAD_DIM, device=device, generator=generator).to(torch.bfloat16)

    def documents(lengths: list[int]) -> torch.Tensor:
        row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        return torch.stack([row, row.flip(0)]).to(device)

    compiled = _Compiled(FlexAttentionBackend(torch_flash=torch_flash))
    layouts = [[100, 312, 311, 301], [100, 312, 311, 301], [1000, 24], [7, 513, 200, 150, 154]]
    for lengths in layouts:
        inputs = (sample(Q_HEADS), sample(KV_HEADS), sample(KV_HEADS))
        if torch_flash and not TorchFlashAttention().runs(*(t.requires_grad_() for t in inputs)):
            pytest.skip("this torch or GPU has no FlashAttention kernel for these inputs")
        upstream = sample(Q_HEADS)
        kw = {"causal": True, "window": None, "documents": documents(lengths)}
        reference = _run(EagerAttentionBackend(), inputs, upstream, **kw, dtype=torch.float32)
        sdpa = _run(SdpaAttentionBackend(), inputs, upstream, **kw, dtype=torch.bfloat16)
        got = _run(compiled, inputs, upstream, **kw, dtype=torch.bfloat16)
        _assert_within_sdpa_bound(f"compiled flex_attention {torch_flash=} {lengths}", got, sdpa, reference)


@pytest.mark.parametrize(("causal", "window", "packed", "batch", "seq"), FLASH_MASK_CASES)
def test_flexattention_kernel_windows_and_documents_match_fp32_reference_like_sdpa(
    causal: bool, window: int | None, packed: bool, batch: int, seq: int
) -> None:
    """Where PyTorch's FlashAttention kernels do not run (here ``torch_flash=False``; float32 or an
    unsupported head dim elsewhere), windows and packed documents run on FlexAttention's kernel."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def sample(heads: int) -> torch.Tensor:
        return torch.randn(batch, seq, heads, HEAD_DIM, device=device, generator=generator).to(torch.bfloat16)

    inputs = (sample(Q_HEADS), sample(KV_HEADS), sample(KV_HEADS))
    upstream = sample(Q_HEADS)
    documents = _documents(batch, seq, device) if packed else None
    kw = {"causal": causal, "window": window, "documents": documents}
    reference = _run(EagerAttentionBackend(), inputs, upstream, **kw, dtype=torch.float32)
    sdpa = _run(SdpaAttentionBackend(), inputs, upstream, **kw, dtype=torch.bfloat16)
    got = _run(FlexAttentionBackend(torch_flash=False), inputs, upstream, **kw, dtype=torch.bfloat16)
    _assert_within_sdpa_bound("flex_attention kernel", got, sdpa, reference)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize(
    ("causal", "window"),
    [(True, None), (True, WINDOW), (False, None)],
    ids=["causal", "causal-window", "bidirectional"],
)
def test_flash_attention_4_compiles_into_one_graph_and_matches_fp32_reference_like_sdpa(
    head_dim: int, causal: bool, window: int | None
) -> None:
    """Rows without documents compile with ``fullgraph=True``: FlashAttention 4 through its custom
    ops, and on Hopper full causal rows wider than 128 through SDPA, at Gemma-3-1B's heads (4 query
    heads, 1 key/value head)."""
    compiled = _Compiled(_flash_backend("flash_attention_4"), fullgraph=True)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def sample(heads: int) -> torch.Tensor:
        return torch.randn(2, 1024, heads, head_dim, device=device, generator=generator).to(torch.bfloat16)

    inputs = (sample(4), sample(1), sample(1))
    upstream = sample(4)
    kw = {"causal": causal, "window": window, "documents": None}
    reference = _run(EagerAttentionBackend(), inputs, upstream, **kw, dtype=torch.float32)
    sdpa = _run(SdpaAttentionBackend(), inputs, upstream, **kw, dtype=torch.bfloat16)
    got = _run(compiled, inputs, upstream, **kw, dtype=torch.bfloat16)
    _assert_within_sdpa_bound(f"compiled flash_attention_4 {head_dim=}", got, sdpa, reference)
