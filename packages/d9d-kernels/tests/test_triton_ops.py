"""Every op's Triton path against its PyTorch reference: forward and gradients, fp32 and bf16.

On CPU the kernels run in Triton's interpreter at small shapes; the ``gpu`` cases run compiled
kernels at Qwen3-8B-like shapes, with odd sizes (hidden 2880, vocab 151936, ignored labels).
"""

import pytest
import torch

from d9d.kernels import (
    KernelBackend,
    apply_rope,
    grouped_mm,
    linear_cross_entropy,
    linear_cross_entropy_chunk_tokens,
    moe_permute,
    moe_unpermute,
    rms_norm,
    rms_norm_add,
    swiglu,
)

from ._compare import DEVICES, DTYPES, assert_matches_reference


def _gen(device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _randn(*shape: int, device: str) -> torch.Tensor:
    return torch.randn(*shape, device=device, generator=_gen(device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "zero_centered",
    [
        False,  # y = x_hat * weight
        True,  # y = x_hat * (1 + weight)
    ],
)
def test_rms_norm(device: str, dtype: torch.dtype, zero_centered: bool) -> None:
    rows, hidden = (13, 72) if device == "cpu" else (8192, 2880)  # neither a power of two
    x = _randn(rows, hidden, device=device).view(-1, 1, hidden) * 3
    weight = _randn(hidden, device=device) * 0.1 + (0.0 if zero_centered else 1.0)
    assert_matches_reference(
        lambda x, w, backend: rms_norm(x, w, 1e-6, zero_centered_weight=zero_centered, backend=backend),
        [x, weight], [0, 1], dtype, fp32_tolerance=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("then", "scale"),
    [
        (True, 1.0),  # Gemma 3: post-attention norm, the add, the pre-feed-forward norm
        (False, 1.0),  # OLMo 2, and Gemma's post-feed-forward norm: the add alone
        (True, 0.25),  # a residual multiplier on the normalized branch
    ],
)
@pytest.mark.parametrize(
    ("cpu_shape", "gpu_shape"),
    [
        pytest.param((13, 72), (16384, 1152), id="gemma-1b"),  # Gemma-3-1B's width: no power of two
        pytest.param((5, 2560), (8195, 2560), id="gemma-4b"),  # two-row tiles of 4096 backward
    ],
)
def test_rms_norm_add(
    device: str,
    dtype: torch.dtype,
    then: bool,
    scale: float,
    cpu_shape: tuple[int, int],
    gpu_shape: tuple[int, int],
) -> None:
    rows, hidden = cpu_shape if device == "cpu" else gpu_shape
    residual = _randn(rows, hidden, device=device).view(-1, 1, hidden)
    branch = _randn(rows, hidden, device=device).flip(0).view(-1, 1, hidden) * 3
    weight = _randn(hidden, device=device) * 0.1
    next_weight = _randn(hidden, device=device).flip(0) * 0.1 + 1.0

    def op(
        r: torch.Tensor, b: torch.Tensor, w: torch.Tensor, nw: torch.Tensor, backend: object
    ) -> torch.Tensor:
        total, normed = rms_norm_add(
            r,
            b,
            w,
            1e-6,
            zero_centered_weight=True,
            scale=scale,
            next_weight=nw if then else None,
            next_eps=1e-5,
            backend=backend,  # pyright: ignore[reportArgumentType]
        )
        return total if normed is None else torch.stack((total, normed))

    assert_matches_reference(
        op, [residual, branch, weight, next_weight], [0, 1, 2, 3] if then else [0, 1, 2], dtype
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_on_strided_halves(device: str, dtype: torch.dtype) -> None:
    # gate and up as the two halves of one fused projection: row-strided views
    rows, inter = (9, 100) if device == "cpu" else (4096, 12288)
    fused = _randn(rows, 2 * inter, device=device) * 2

    def op(fused: torch.Tensor, backend: object) -> torch.Tensor:
        return swiglu(fused[:, :inter], fused[:, inter:], backend=backend)  # pyright: ignore[reportArgumentType]

    assert_matches_reference(op, [fused], [0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "layout",
    [
        "half",  # Llama / Qwen
        "interleaved",  # GPT-J
    ],
)
def test_apply_rope_on_strided_heads(device: str, dtype: torch.dtype, layout: str) -> None:
    batch, seq, heads, head_dim = (2, 5, 3, 12) if device == "cpu" else (2, 2048, 32, 128)
    qkv = _randn(batch, seq, 3 * heads, head_dim, device=device)
    freqs = _randn(1, seq, head_dim // 2, device=device) * 3
    angles = torch.cat((freqs, freqs), -1) if layout == "half" else freqs.repeat_interleave(2, -1)
    cos, sin = angles.cos().expand(batch, -1, -1), angles.sin().expand(batch, -1, -1)

    def op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: object) -> torch.Tensor:
        query = qkv[:, :, heads : 2 * heads]  # a strided view, as after a fused QKV projection
        return apply_rope(query, cos, sin, layout=layout, backend=backend)  # pyright: ignore[reportArgumentType]

    assert_matches_reference(op, [qkv, cos, sin], [0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "reduction",
    [
        "mean",  # gradients computed in the forward, scaled in the backward
        "sum",
        "none",  # gradients recomputed in the backward with per-token upstream gradients
    ],
)
def test_linear_cross_entropy(device: str, dtype: torch.dtype, reduction: str) -> None:
    n, hidden, vocab, chunk = (37, 16, 1000, 8) if device == "cpu" else (4096, 2560, 151936, 1024)
    h = _randn(n, hidden, device=device)
    w = _randn(vocab, hidden, device=device) * (1.0 / hidden**0.5)
    labels = torch.randint(0, vocab, (n,), device=device, generator=_gen(device))
    labels[::7] = -100  # ignored tokens

    def op(h: torch.Tensor, w: torch.Tensor, backend: object) -> torch.Tensor:
        return linear_cross_entropy(h, w, labels, reduction=reduction, chunk_size=chunk, backend=backend)  # pyright: ignore[reportArgumentType]

    assert_matches_reference(op, [h, w], [0, 1], dtype, fp32_tolerance=2e-5, bf16_slack=3.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "upstream",
    [
        "sum",  # every target token's loss gets the same upstream gradient: all gradients exact
        "per_token",  # a different gradient per token: the hidden gradient stays exact
    ],
)
def test_linear_cross_entropy_uniform_upstream_gradient(
    device: str, dtype: torch.dtype, upstream: str
) -> None:
    n, hidden, vocab, chunk = (37, 16, 1000, 8) if device == "cpu" else (4096, 2560, 151936, 1024)
    h = _randn(n, hidden, device=device)
    w = _randn(vocab, hidden, device=device) * (1.0 / hidden**0.5)
    labels = torch.randint(0, vocab, (n,), device=device, generator=_gen(device))
    labels[::7] = -100
    count = (labels != -100).sum()

    def op(h: torch.Tensor, w: torch.Tensor, backend: object) -> torch.Tensor:
        losses = linear_cross_entropy(
            h,
            w,
            labels,
            reduction="none",
            uniform_upstream_gradient=True,
            chunk_size=chunk,
            backend=backend,  # pyright: ignore[reportArgumentType]
        )
        return losses.sum() / count if upstream == "sum" else losses

    differentiable = [0, 1] if upstream == "sum" else [0]
    assert_matches_reference(op, [h, w], differentiable, dtype, fp32_tolerance=2e-5, bf16_slack=3.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_moe_permute_unpermute(device: str, dtype: torch.dtype) -> None:
    tokens, hidden, experts, top_k = (11, 20, 5, 3) if device == "cpu" else (8192, 2048, 64, 8)
    h = _randn(tokens, hidden, device=device)
    scores = torch.rand(tokens, experts, device=device, generator=_gen(device))
    weights, indices = scores.topk(top_k, dim=-1)
    scale = torch.linspace(0.5, 1.5, tokens * top_k, device=device)[:, None]

    def op(h: torch.Tensor, weights: torch.Tensor, backend: object) -> torch.Tensor:
        permuted, counts, permutation = moe_permute(h, indices, experts, backend=backend)  # pyright: ignore[reportArgumentType]
        assert int(counts.sum()) == tokens * top_k
        return moe_unpermute(permuted * scale.to(permuted.dtype), permutation, weights, backend=backend)  # pyright: ignore[reportArgumentType]

    assert_matches_reference(op, [h, weights], [0, 1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mm(device: str, dtype: torch.dtype) -> None:
    if device == "cpu":
        sizes, k, n = [20, 0, 3, 45, 1], 24, 40  # an empty group and groups smaller than a tile
    else:
        sizes, k, n = [int(s) for s in torch.randint(0, 1024, (64,), generator=_gen("cpu"))], 2048, 768
        sizes[5] = 0
    x = _randn(sum(sizes), k, device=device)
    w = _randn(len(sizes), k, n, device=device) * (1.0 / k**0.5)
    tokens = torch.tensor(sizes, device=device)

    def op(x: torch.Tensor, w: torch.Tensor, backend: object) -> torch.Tensor:
        return grouped_mm(x, w, tokens, backend=backend)  # pyright: ignore[reportArgumentType]

    assert_matches_reference(op, [x, w], [0, 1], dtype, fp32_tolerance=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mm_auto_path_on_gpu() -> None:
    # On sm90 bf16 this is PyTorch's grouped GEMM (with its own autograd), not the Triton kernel.
    sizes = [int(s) for s in torch.randint(0, 1024, (64,), generator=_gen("cpu"))]
    sizes[3] = 0
    x = _randn(sum(sizes), 2048, device="cuda")
    w = _randn(64, 2048, 768, device="cuda") * (1.0 / 2048**0.5)
    tokens = torch.tensor(sizes, device="cuda")

    def op(x: torch.Tensor, w: torch.Tensor, backend: object) -> torch.Tensor:
        if backend == KernelBackend.TRITON:
            backend = KernelBackend.AUTO
        return grouped_mm(x, w, tokens, backend=backend)  # pyright: ignore[reportArgumentType]

    assert_matches_reference(op, [x, w], [0, 1], torch.bfloat16)


@pytest.mark.parametrize(
    ("tokens", "vocab", "rows"),
    [
        (4096, 151936, 1024),  # a quarter of the tokens is more than 256 MiB of logits (768 tokens)
        (16384, 151936, 4096),  # 4 chunks, not 22
        (16384, 262144, 4096),  # Gemma 3's vocabulary: 2 GiB of logits
        (65536, 151936, 6912),  # a quarter would pass 2 GiB of logits: as many as fit, in 256s
        (2048, 151936, 768),  # 256 MiB of logits, in multiples of 256 tokens, is more than a quarter
        (100, 151936, 100),  # all of a short batch
        (5000, 10**7, 13),  # a row wider than 256 MiB / 256 tokens: as many as fit 256 MiB
    ],
)
def test_linear_cross_entropy_default_chunks(tokens: int, vocab: int, rows: int) -> None:
    assert linear_cross_entropy_chunk_tokens(tokens, vocab, 2) == rows
    pytest.importorskip("triton")
    from d9d.kernels._triton.linear_cross_entropy_kernels import (
        _chunk_rows,  # pyright: ignore[reportPrivateUsage]
    )

    assert _chunk_rows(tokens, vocab, 2, 0) == rows, "the Triton path uses the public rule"
    assert _chunk_rows(tokens, vocab, 2, 100) == 100, "an explicit chunk_size wins"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_scale_in_place_rounds_as_mul(device: str, dtype: torch.dtype) -> None:
    from d9d.kernels._triton.linear_cross_entropy_kernels import scale_in_place

    n = 8192 * 2 + 37 if device == "cpu" else 262144 * 1152 + 3  # past a block boundary
    x = _randn(n, device=device).to(dtype)
    scale = (_randn(1, device=device) * 3).to(dtype)
    expected = x.clone().mul_(scale)
    scale_in_place(x, scale)
    # Triton's interpreter rounds fp32 to bf16 towards zero: one unit in the last place there
    ulp = 2.0**-7 if dtype == torch.bfloat16 and device == "cpu" else 0.0
    torch.testing.assert_close(x, expected, rtol=ulp, atol=0)
    with pytest.raises(ValueError, match="not contiguous"):
        scale_in_place(x[: n - 1].view(-1)[::2], scale)
    with pytest.raises(ValueError, match="2 elements"):
        scale_in_place(x, scale.repeat(2))
