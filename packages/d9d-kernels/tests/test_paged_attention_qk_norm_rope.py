"""paged_decode_attention with ``qk_norm_rope``: the per-head norms and rotation inside the attention.

Every path must give what ``qk_norm_rope`` followed by the attention with its write gives, and leave
the same pool (the normalized, rotated keys): the reference, the Triton kernel (each program
normalizes and rotates what it loads) and the compiled path (the separate ops, then the custom op).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from d9d.kernels import KernelBackend, QKNormRope, RopeLayout, paged_decode_attention, qk_norm_rope

from ._modules import PAGE, paged_decode_step

_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)
SCALE = 0.25


def _rope_tables(
    positions: torch.Tensor, head_dim: int, layout: RopeLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, head_dim)`` cosines and sines of the whole head at ``positions``."""
    inv_freq = 1.0 / (1000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    match layout:
        case "half":
            angles = torch.cat([angles, angles], dim=-1)
        case "interleaved":
            angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def _decode_step(
    lengths: list[int],
    *,
    layout: RopeLayout = "half",
    zero_centered: bool = False,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], QKNormRope]:
    """``paged_decode_step``'s pool with the rows' queries and new keys taken as projected (not yet
    normalized or rotated), and the norms' weights and rotation tables."""
    step = paged_decode_step(lengths, kv_heads=kv_heads, head_dim=head_dim, value_dim=head_dim)
    step["query"] = 3 * step["query"]  # mean squares away from one: the norms show
    step = {name: t.to(dtype) if t.is_floating_point() else t for name, t in step.items()}
    gen = torch.Generator().manual_seed(head_dim)
    cos, sin = _rope_tables((step["lengths"].long() - 1).clamp_min(0), head_dim, layout)
    prologue = QKNormRope(
        q_weight=(0.5 + torch.rand(head_dim, generator=gen)).to(dtype),
        k_weight=(0.5 + torch.rand(head_dim, generator=gen)).to(dtype),
        cos=cos.to(dtype),
        sin=sin.to(dtype),
        eps=1e-6,
        zero_centered_weight=zero_centered,
        layout=layout,
    )
    return step, prologue


def _normalized_then_attended(
    step: dict[str, torch.Tensor],
    prologue: QKNormRope,
    norm_backend: KernelBackend = KernelBackend.REFERENCE,
    **options: object,
) -> tuple[torch.Tensor, ...]:
    """The unfused form: ``qk_norm_rope`` (by ``norm_backend``), then the attention with its write
    (the reference)."""
    tables = replace(prologue, cos=prologue.cos[:, None], sin=prologue.sin[:, None])
    query, new_key = tables.apply(step["query"][:, None], step["new_key"][:, None], backend=norm_backend)
    keys, values = step["key_cache"].clone(), step["value_cache"].clone()
    out = paged_decode_attention(
        query[:, 0], keys, values, step["block_table"], step["lengths"], page_size=PAGE, softmax_scale=SCALE,
        new_key=new_key[:, 0], new_value=step["new_value"], write_slots=step["write_slots"],
        backend=KernelBackend.REFERENCE, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    return out, keys, values


def _fused(
    step: dict[str, torch.Tensor], prologue: QKNormRope, backend: KernelBackend, **options: object
) -> tuple[torch.Tensor, ...]:
    keys, values = step["key_cache"].clone(), step["value_cache"].clone()
    out = paged_decode_attention(
        step["query"], keys, values, step["block_table"], step["lengths"], page_size=PAGE,
        softmax_scale=SCALE, new_key=step["new_key"], new_value=step["new_value"],
        write_slots=step["write_slots"], qk_norm_rope=prologue, backend=backend, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    return out, keys, values


def _assert_same(
    got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], tol: float = 1e-5
) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], expected[1], rtol=tol, atol=tol, msg="the key pools differ")
    assert torch.equal(got[2], expected[2]), "the value pools differ"


def test_the_reference_normalizes_rotates_writes_then_attends() -> None:
    step, prologue = _decode_step([7, 1, 20, 0, 13])
    got = _fused(step, prologue, KernelBackend.REFERENCE)
    expected = _normalized_then_attended(step, prologue)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


@_INTERPRETER
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    ("lengths", "prologue_options", "options"),
    [
        ([7, 1, 20, 0, 13], {}, {}),  # a length-1 row (its only position is the new one), a full table, idle
        ([1, 6, 19, 0], {"layout": "interleaved"}, {"sliding_window": 5}),
        ([3, 17], {"zero_centered": True}, {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}),
        ([9, 4], {"head_dim": 24}, {}),  # a head narrower than its power-of-two tile
    ],
    ids=["half", "interleaved-window", "zero-centered-sinks", "padded-head"],
)
def test_the_kernel_normalizes_and_rotates_what_it_loads(
    lengths: list[int], prologue_options: dict[str, object], options: dict[str, object], num_splits: int
) -> None:
    from d9d.kernels._paged_attention_inputs import PagedDecodeInputs
    from d9d.kernels._triton.paged_attention_op import paged_decode_attention_triton

    step, prologue = _decode_step(lengths, **prologue_options)  # type: ignore[arg-type]
    keys, values = step["key_cache"].clone(), step["value_cache"].clone()
    inputs = PagedDecodeInputs(
        query=step["query"], key_cache=keys, value_cache=values, block_table=step["block_table"],
        lengths=step["lengths"], page_size=PAGE, softmax_scale=SCALE,
        sliding_window=options.get("sliding_window"), sinks=options.get("sinks"),  # type: ignore[arg-type]
        new_key=step["new_key"], new_value=step["new_value"], write_slots=step["write_slots"],
        qk_norm_rope=prologue,
    )  # fmt: skip
    inputs.check()
    out = paged_decode_attention_triton(inputs, num_splits=num_splits)
    _assert_same((out, keys, values), _normalized_then_attended(step, prologue, **options))


@_INTERPRETER
def test_the_kernel_rounds_as_qk_norm_rope_in_bf16() -> None:
    """bf16 inputs: the norm is rounded before the rotation, the rotated key before it is stored, as
    ``qk_norm_rope``'s own kernel rounds them (the launch this one replaces)."""
    step, prologue = _decode_step([6, 11, 2], dtype=torch.bfloat16)
    got = _fused(step, prologue, KernelBackend.TRITON)
    expected = _normalized_then_attended(step, prologue, KernelBackend.TRITON)
    torch.testing.assert_close(got[0].float(), expected[0].float(), rtol=2e-2, atol=2e-2)
    written = step["write_slots"]
    assert torch.equal(got[1][written], expected[1][written]), "the stored keys differ"


@_INTERPRETER
def test_compiled_calls_normalize_with_the_separate_ops_and_attend_through_the_custom_op() -> None:
    step, prologue = _decode_step([9, 4, 0])

    def attend(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention(
            step["query"], keys, values, step["block_table"], step["lengths"], page_size=PAGE,
            softmax_scale=SCALE, new_key=step["new_key"], new_value=step["new_value"],
            write_slots=step["write_slots"], qk_norm_rope=prologue, backend=KernelBackend.TRITON,
        )  # fmt: skip

    keys, values = step["key_cache"].clone(), step["value_cache"].clone()
    out = torch.compile(attend, backend="aot_eager", fullgraph=True)(keys, values)
    _assert_same((out, keys, values), _normalized_then_attended(step, prologue))


def test_qk_norm_rope_without_the_write_is_refused() -> None:
    step, prologue = _decode_step([3, 5])
    with pytest.raises(ValueError, match="qk_norm_rope needs new_key, new_value and write_slots"):
        paged_decode_attention(
            step["query"], step["key_cache"], step["value_cache"], step["block_table"], step["lengths"],
            page_size=PAGE, softmax_scale=SCALE, qk_norm_rope=prologue,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q_weight": torch.ones(8)}, r"qk_norm_rope.q_weight must be a floating \(16,\) tensor"),
        ({"k_weight": torch.ones(16, dtype=torch.int64)}, r"qk_norm_rope.k_weight must be a floating"),
        ({"cos": torch.ones(3, 16)}, r"qk_norm_rope.cos must be a floating \(2, 16\) tensor"),
        ({"sin": torch.ones(2, 1, 16)}, r"qk_norm_rope.sin must be a floating \(2, 16\) tensor"),
    ],
)
def test_a_prologue_that_does_not_fit_is_refused(change: dict[str, torch.Tensor], message: str) -> None:
    step, prologue = _decode_step([3, 5])
    with pytest.raises(ValueError, match=message):
        _fused(step, replace(prologue, **change), KernelBackend.REFERENCE)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [2, 64])
def test_the_kernel_normalizes_at_qwen3_shapes_on_gpu(rows: int) -> None:
    """Qwen3-0.6B's heads (16 query, 8 kv, 128 wide), bf16, lengths 1 to 20 and one idle row; the
    GPU's splits, against ``qk_norm_rope``'s kernel and then the attention's."""
    lengths = [0] + [1 + (7 * row) % 20 for row in range(1, rows)]
    cpu_step, cpu_prologue = _decode_step(lengths, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    step = {name: t.cuda() for name, t in cpu_step.items()}
    prologue = replace(
        cpu_prologue,
        q_weight=cpu_prologue.q_weight.cuda(),
        k_weight=cpu_prologue.k_weight.cuda(),
        cos=cpu_prologue.cos.cuda(),
        sin=cpu_prologue.sin.cuda(),
    )
    got = _fused(step, prologue, KernelBackend.TRITON)
    query, new_key = qk_norm_rope(
        step["query"][:, None], step["new_key"][:, None], prologue.q_weight, prologue.k_weight,
        prologue.cos[:, None], prologue.sin[:, None], eps=prologue.eps,
    )  # fmt: skip
    keys, values = step["key_cache"].clone(), step["value_cache"].clone()
    expected = paged_decode_attention(
        query[:, 0], keys, values, step["block_table"], step["lengths"], page_size=PAGE, softmax_scale=SCALE,
        new_key=new_key[:, 0], new_value=step["new_value"], write_slots=step["write_slots"],
    )  # fmt: skip
    torch.testing.assert_close(got[0].float(), expected.float(), rtol=2e-2, atol=2e-2)
    written = step["write_slots"][1:]  # the idle row's scratch slot is not compared
    torch.testing.assert_close(got[1][written].float(), keys[written].float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(got[2], values), "the value pools differ"
