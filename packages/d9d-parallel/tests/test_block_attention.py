import pytest
import torch
from torch.nn import functional

from d9d.parallel._block_attention import (
    CpuFlashBlockAttention,
    attend_chunk_causally,
    block_attention_kernel_for,
)


def _reference(query, key, value, start, scale):
    """Chunk queries at positions [start, start + n) over keys [0, start + n), written out."""
    n = query.shape[2]
    end = start + n
    repeat = query.shape[1] // key.shape[1]
    k = key[:, :, :end].repeat_interleave(repeat, 1)
    v = value[:, :, :end].repeat_interleave(repeat, 1)
    i = torch.arange(start, end).unsqueeze(1)
    j = torch.arange(end).unsqueeze(0)
    scores = (query @ k.transpose(-1, -2)) * scale
    return scores.masked_fill(j > i, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize(("start", "kv_len"), [(0, 6), (6, 12), (12, 24), (18, 24)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_chunk_attention_equals_lower_right_causal_attention_with_gradients(start, kv_len, kv_heads) -> None:
    generator = torch.Generator().manual_seed(start + kv_heads)
    batch, heads, n, dim, scale = 2, 4, 6, 8, 0.3
    # Heads stored sequence-major and transposed, as attention layers hand them over.
    query = torch.randn(batch, n, heads, dim, generator=generator).transpose(1, 2).requires_grad_()
    key = torch.randn(batch, kv_len, kv_heads, dim, generator=generator).transpose(1, 2).requires_grad_()
    value = torch.randn(batch, kv_len, kv_heads, dim, generator=generator).transpose(1, 2).requires_grad_()
    grad = torch.randn(batch, heads, n, dim, generator=generator)

    out = attend_chunk_causally(query, key, value, start=start, scale=scale, kernel=CpuFlashBlockAttention())
    grads = torch.autograd.grad(out, (query, key, value), grad)
    expected = _reference(query, key, value, start, scale)
    expected_grads = torch.autograd.grad(expected, (query, key, value), grad)

    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("query", "key", "value"), grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # keys past the chunk's end get no gradient
    assert not grads[1][:, :, start + n :].any()


def test_chunk_attention_merges_in_float32_for_bf16_inputs() -> None:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 8, 16, generator=generator)
    key = torch.randn(1, 2, 32, 16, generator=generator)
    value = torch.randn(1, 2, 32, 16, generator=generator)
    kernel = CpuFlashBlockAttention()
    q, k, v = query.bfloat16(), key.bfloat16(), value.bfloat16()
    low = attend_chunk_causally(q, k, v, start=24, scale=0.25, kernel=kernel)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), _reference(query, key, value, 24, 0.25), rtol=2e-2, atol=2e-2)


def test_kernel_choice_by_device_dtype_and_head_size() -> None:
    assert isinstance(block_attention_kernel_for(torch.zeros(1, 1, 1, 8)), CpuFlashBlockAttention)
    assert block_attention_kernel_for(torch.zeros(1, 1, 1, 8, device="meta")) is None


def test_matches_public_sdpa_lower_right_bias() -> None:
    from torch.nn.attention.bias import CausalBias, CausalVariant

    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 8, 8, generator=generator)
    key = torch.randn(1, 4, 24, 8, generator=generator)
    value = torch.randn(1, 4, 24, 8, generator=generator)
    out = attend_chunk_causally(query, key, value, start=16, scale=0.35, kernel=CpuFlashBlockAttention())
    expected = functional.scaled_dot_product_attention(
        query, key, value, attn_mask=CausalBias(CausalVariant.LOWER_RIGHT, 8, 24), scale=0.35
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_indices", [(0, 3), (1, 2)])
def test_context_parallel_rank_attention_is_the_same_with_and_without_block_kernel(chunk_indices) -> None:
    from d9d.parallel._context_parallel_attention import _attend_unmasked

    generator = torch.Generator().manual_seed(sum(chunk_indices))
    batch, length, heads, kv_heads, dim, chunk = 2, 16, 4, 2, 8, 4
    full_key = torch.randn(batch, length, kv_heads, dim, generator=generator).requires_grad_()
    full_value = torch.randn(batch, length, kv_heads, dim, generator=generator).requires_grad_()
    query = torch.randn(batch, 2 * chunk, heads, dim, generator=generator).requires_grad_()
    grad = torch.randn(batch, 2 * chunk, heads, dim, generator=generator)
    results = []
    for kernel in (CpuFlashBlockAttention(), None):
        out = _attend_unmasked(
            query, full_key, full_value, causal=True, softmax_scale=0.3, chunk_indices=chunk_indices,
            kernel=kernel,
        )  # fmt: skip
        results.append((out, *torch.autograd.grad(out, (query, full_key, full_value), grad)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_rank_attention_equals_eager() -> None:
    from d9d.parallel._context_parallel_attention import _attend_unmasked

    generator = torch.Generator().manual_seed(5)
    full_key = torch.randn(2, 16, 2, 8, generator=generator).requires_grad_()
    full_value = torch.randn(2, 16, 2, 8, generator=generator).requires_grad_()
    query = torch.randn(2, 8, 4, 8, generator=generator).requires_grad_()
    grad = torch.randn(2, 8, 4, 8, generator=generator)

    def attend(q, k, v):
        out = _attend_unmasked(
            q * 1.5,
            k,
            v,
            causal=True,
            softmax_scale=0.3,
            chunk_indices=(0, 3),
            kernel=CpuFlashBlockAttention(),
        )
        return out.tanh()

    results = []
    for fn in (attend, torch.compile(attend)):
        out = fn(query, full_key, full_value)
        results.append((out, *torch.autograd.grad(out, (query, full_key, full_value), grad)))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
