"""paged_decode_attention with a write: the new keys and values stored by the call itself.

Every path must give what ``index_copy_`` of the new tokens followed by the attention gives, and
leave the same pool: the reference (index_copy_, then the gather), the Triton kernel (the first
split stores, every program reads the written slot from the inputs) and the compiled path.
"""

from __future__ import annotations

import os

import pytest
import torch

from d9d.kernels import KernelBackend, paged_decode_attention

from ._modules import PAGE, paged_decode_step

_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


def _written_then_attended(step: dict[str, torch.Tensor], **options: object) -> tuple[torch.Tensor, ...]:
    """The unfused form: ``index_copy_`` the new tokens, then attend over the pool."""
    keys, values = step["key_cache"].clone(), step["value_cache"].clone()
    slots = step["write_slots"].long()
    keys.index_copy_(0, slots, step["new_key"])
    values.index_copy_(0, slots, step["new_value"])
    out = paged_decode_attention(
        step["query"], keys, values, step["block_table"], step["lengths"], page_size=PAGE,
        softmax_scale=0.25, backend=KernelBackend.REFERENCE, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    return out, keys, values


def _fused(
    step: dict[str, torch.Tensor], backend: KernelBackend, **options: object
) -> tuple[torch.Tensor, ...]:
    keys, values = step["key_cache"].clone(), step["value_cache"].clone()
    out = paged_decode_attention(
        step["query"], keys, values, step["block_table"], step["lengths"], page_size=PAGE,
        softmax_scale=0.25, new_key=step["new_key"], new_value=step["new_value"],
        write_slots=step["write_slots"], backend=backend, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    return out, keys, values


def _assert_same(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2]), "the pools differ"


def test_the_reference_writes_then_attends() -> None:
    step = paged_decode_step([7, 1, 20, 0, 13])
    _assert_same(_fused(step, KernelBackend.REFERENCE), _written_then_attended(step))


@_INTERPRETER
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    ("lengths", "options"),
    [
        ([7, 1, 20, 0, 13], {}),  # a length-1 row (its only position is the new one), a full table, idle
        ([1, 6, 19, 0], {"sliding_window": 5}),
        ([3, 17], {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}),
    ],
    ids=["mixed", "window", "sinks"],
)
def test_the_kernel_stores_the_new_tokens_and_attends_to_them(
    lengths: list[int], options: dict[str, object], num_splits: int
) -> None:
    from d9d.kernels._paged_attention_inputs import PagedDecodeInputs
    from d9d.kernels._triton.paged_attention_op import paged_decode_attention_triton

    step = paged_decode_step(lengths)
    keys, values = step["key_cache"].clone(), step["value_cache"].clone()
    inputs = PagedDecodeInputs(
        query=step["query"], key_cache=keys, value_cache=values, block_table=step["block_table"],
        lengths=step["lengths"], page_size=PAGE, softmax_scale=0.25,
        sliding_window=options.get("sliding_window"), sinks=options.get("sinks"),  # type: ignore[arg-type]
        new_key=step["new_key"], new_value=step["new_value"], write_slots=step["write_slots"],
    )  # fmt: skip
    inputs.check()
    out = paged_decode_attention_triton(inputs, num_splits=num_splits)
    _assert_same((out, keys, values), _written_then_attended(step, **options))


@_INTERPRETER
def test_the_kernel_takes_int32_slots_and_strided_new_tokens() -> None:
    step = paged_decode_step([5, 12], value_dim=8)
    step["write_slots"] = step["write_slots"].to(torch.int32)
    wide = torch.randn(2, 2, 32)
    wide[..., ::2] = step["new_key"]
    step["new_key"] = wide[..., ::2]  # a last stride of 2: copied before the launch
    _assert_same(_fused(step, KernelBackend.TRITON), _written_then_attended(step))


@_INTERPRETER
def test_compiled_calls_write_with_index_copy_and_attend_through_the_custom_op() -> None:
    step = paged_decode_step([9, 4, 0])

    def attend(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention(
            step["query"], keys, values, step["block_table"], step["lengths"], page_size=PAGE,
            softmax_scale=0.25, new_key=step["new_key"], new_value=step["new_value"],
            write_slots=step["write_slots"], backend=KernelBackend.TRITON,
        )  # fmt: skip

    keys, values = step["key_cache"].clone(), step["value_cache"].clone()
    out = torch.compile(attend, backend="aot_eager", fullgraph=True)(keys, values)
    _assert_same((out, keys, values), _written_then_attended(step))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"new_value": None}, "new_key, new_value and write_slots go together"),
        ({"new_key": torch.zeros(3, 2, 16)}, r"new_key must be torch.float32 \(2, 2, 16\)"),
        ({"new_value": torch.zeros(2, 2, 16, dtype=torch.float64)}, "new_value must be torch.float32"),
        ({"write_slots": torch.zeros(2)}, "write_slots must be int32 or int64"),
    ],
)
def test_a_write_that_does_not_fit_is_refused(change: dict[str, torch.Tensor | None], message: str) -> None:
    step: dict[str, torch.Tensor | None] = {**paged_decode_step([3, 5]), **change}
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(
            step["query"], step["key_cache"], step["value_cache"], step["block_table"], step["lengths"],  # type: ignore[arg-type]
            page_size=PAGE, softmax_scale=0.25, new_key=step["new_key"], new_value=step["new_value"],
            write_slots=step["write_slots"],
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [2, 64])
def test_the_kernel_writes_at_qwen3_shapes_on_gpu(rows: int) -> None:
    """Qwen3-0.6B's heads (16 query, 8 kv, 128 wide), bf16, lengths 1 to 20 and one idle row (only
    one: idle rows share a scratch slot, where the last writer is unspecified); the GPU's splits."""
    lengths = [0] + [1 + (7 * row) % 20 for row in range(1, rows)]
    cpu = paged_decode_step(lengths, kv_heads=8, head_dim=128, value_dim=128)
    step = {
        name: t.to("cuda", torch.bfloat16) if t.is_floating_point() else t.cuda() for name, t in cpu.items()
    }
    got = _fused(step, KernelBackend.TRITON)
    expected = _written_then_attended(step)
    torch.testing.assert_close(got[0].float(), expected[0].float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2]), "the pools differ"
