"""qk_norm_rope: the fused kernel against rms_norm then apply_rope, and the paths that stay separate."""

from __future__ import annotations

import os

import pytest
import torch

from d9d.kernels import KernelBackend, apply_rope, qk_norm_rope, rms_norm

from ._compare import assert_matches_reference

_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)
_REFERENCE = KernelBackend.REFERENCE


def _operands(
    dtype: torch.dtype, *, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 16, seq: int = 3
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(q_heads * 10 + head_dim)
    query = torch.randn(2, seq, q_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(2, seq, kv_heads, head_dim, generator=gen).to(dtype)
    q_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    k_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    angles = torch.randn(2, seq, head_dim, generator=gen)
    return query, key, q_weight, k_weight, angles.cos().to(dtype), angles.sin().to(dtype)


def _separate(
    operands: tuple[torch.Tensor, ...],
    *,
    zero_centered: bool = False,
    layout: str = "half",
    backend: KernelBackend = _REFERENCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    query, key, q_weight, k_weight, cos, sin = operands
    out = []
    for x, weight in ((query, q_weight), (key, k_weight)):
        normed = rms_norm(x, weight, 1e-6, zero_centered_weight=zero_centered, backend=backend)
        out.append(apply_rope(normed, cos, sin, layout=layout, backend=backend))  # type: ignore[arg-type]
    return out[0], out[1]


@_INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["scale", "one-plus-scale"])
def test_one_launch_equals_the_norms_then_the_rotations(
    dtype: torch.dtype, layout: str, zero_centered: bool
) -> None:
    operands = _operands(dtype, q_heads=6, kv_heads=2, head_dim=24)  # heads and halves not powers of two
    with torch.no_grad():
        fused = qk_norm_rope(
            *operands, eps=1e-6, zero_centered_weight=zero_centered, layout=layout,  # type: ignore[arg-type]
            backend=KernelBackend.TRITON,
        )  # fmt: skip
    # the separate Triton kernels (as on the GPU): the norm rounded to bf16 before the rotation in
    # both; only the order of the fp32 sum of squares differs
    with torch.no_grad():
        expected = _separate(
            operands, zero_centered=zero_centered, layout=layout, backend=KernelBackend.TRITON
        )
    # bf16: bit for bit in the interpreter (a norm not rounded before its rotation would differ)
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.0, "atol": 0.0}
    for got, want in zip(fused, expected, strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, **tolerance)


@_INTERPRETER
def test_strided_heads_from_a_wider_projection() -> None:
    query, key, q_weight, k_weight, cos, sin = _operands(torch.float32)
    wide = torch.zeros(2, 3, 4, 32)
    wide[..., :16] = query  # a head stride of 32: read in place
    with torch.no_grad():
        fused = qk_norm_rope(
            wide[..., :16], key, q_weight, k_weight, cos, sin, eps=1e-6, backend=KernelBackend.TRITON
        )
    for got, want in zip(fused, _separate((query, key, q_weight, k_weight, cos, sin)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_with_gradients_the_separate_ops_run_and_differentiate() -> None:
    operands = tuple(t.requires_grad_() for t in _operands(torch.float32))
    fused = qk_norm_rope(*operands, eps=1e-6)
    expected = _separate(operands)
    for got, want in zip(fused, expected, strict=True):
        torch.testing.assert_close(got, want)
    (fused[0].sum() + fused[1].square().sum()).backward()
    assert all(t.grad is not None for t in operands[:4])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"key": torch.zeros(2, 3, 2, 8)}, "does not match query"),
        ({"q_weight": torch.zeros(8)}, r"q_weight must be \(head_dim=16,\)"),
        ({"cos": torch.zeros(2, 3, 8)}, r"cos must be \(batch, seq, head_dim\)"),
        ({"query": torch.zeros(2, 3, 16)}, "query must be"),
    ],
)
def test_operands_that_do_not_fit_are_refused(change: dict[str, torch.Tensor], message: str) -> None:
    names = ["query", "key", "q_weight", "k_weight", "cos", "sin"]
    operands = {**dict(zip(names, _operands(torch.float32), strict=True)), **change}
    with pytest.raises(ValueError, match=message):
        qk_norm_rope(**operands, eps=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seq", [1, 512], ids=["decode", "prefill"])
def test_qwen3_heads_on_gpu_equal_the_separate_kernels(seq: int) -> None:
    """Qwen3-0.6B's heads (16 query, 8 kv, 128 wide), bf16, against the separate Triton kernels."""
    operands = tuple(
        t.cuda() for t in _operands(torch.bfloat16, q_heads=16, kv_heads=8, head_dim=128, seq=seq)
    )
    with torch.no_grad():
        fused = qk_norm_rope(*operands, eps=1e-6)
        expected = _separate(operands, backend=KernelBackend.TRITON)
    for got, want in zip(fused, expected, strict=True):
        # the fp32 sums of squares may add in another order: at most one bf16 step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def _fused_training(layout: str, zero_centered: bool):
    def op(
        query: torch.Tensor,
        key: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: KernelBackend,
    ) -> torch.Tensor:
        q, k = qk_norm_rope(
            query, key, q_weight, k_weight, cos, sin, eps=1e-6, zero_centered_weight=zero_centered,
            layout=layout, backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
        return torch.cat((q.flatten(), k.flatten()))

    return op


@_INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["scale", "one-plus-scale"])
def test_with_gradients_one_kernel_each_way_matches_the_reference(
    dtype: torch.dtype, layout: str, zero_centered: bool
) -> None:
    # 18 positions over 8 persistent programs: several positions a program, a partial last round
    operands = _operands(torch.float32, q_heads=6, kv_heads=2, head_dim=24, seq=9)
    assert_matches_reference(_fused_training(layout, zero_centered), operands, [0, 1, 2, 3], dtype)


@_INTERPRETER
def test_with_gradients_the_compiled_call_is_one_custom_op_each_way() -> None:
    operands = [t.requires_grad_(i < 4) for i, t in enumerate(_operands(torch.float32, seq=5))]
    op = _fused_training("half", True)

    def step(*tensors: torch.Tensor) -> torch.Tensor:
        return op(*tensors, backend=KernelBackend.TRITON).square().sum()

    eager = torch.autograd.grad(step(*operands), operands[:4])
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, want in zip(torch.autograd.grad(compiled(*operands), operands[:4]), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    traced: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, _: list[torch.Tensor]):
        traced.append(gm)
        return gm.forward

    torch._dynamo.reset()  # pyright: ignore[reportPrivateImportUsage]
    recorded = torch.compile(step, backend=record, fullgraph=True)
    for got, want in zip(torch.autograd.grad(recorded(*operands), operands[:4]), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    targets = [str(node.target) for gm in traced for node in gm.graph.nodes if node.op == "call_function"]
    # the traced graph calls the fused op once and no separate norm or rotation
    assert targets.count("d9d_kernels.qk_norm_rope_forward.default") == 1, targets
    assert not any("rsqrt" in target or "pow" in target for target in targets), targets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim", "zero_centered"),
    [(16, 8, 128, False), (4, 1, 256, True)],
    ids=["qwen3-0.6b", "gemma-3-1b"],
)
def test_training_heads_on_gpu_match_the_reference(
    q_heads: int, kv_heads: int, head_dim: int, zero_centered: bool
) -> None:
    operands = [
        t.cuda()
        for t in _operands(torch.float32, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, seq=2048)
    ]
    assert_matches_reference(_fused_training("half", zero_centered), operands, [0, 1, 2, 3], torch.bfloat16)


@_INTERPRETER
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rows_per_tile", [1, 4], ids=["row-tiles", "4-row-tiles"])
def test_kernels_over_many_small_tiles_match_the_reference(layout: str, rows_per_tile: int) -> None:
    """Query rows 2*7*6=84 and key rows 28 over 2 persistent programs: many tiles a program, a
    partial last tile, and key programs whose last round has no rows."""
    from d9d.kernels._triton.qk_norm_rope_kernels import qk_norm_rope_backward, qk_norm_rope_kernel

    operands = [t.requires_grad_(i < 4) for i, t in enumerate(_operands(torch.float32, q_heads=6, seq=7))]
    interleaved = layout == "interleaved"
    expected = _separate(tuple(operands), zero_centered=True, layout=layout)
    grads = [torch.randn_like(t) for t in expected]
    want = torch.autograd.grad(expected, operands[:4], grads)
    with torch.no_grad():
        fused = qk_norm_rope_kernel(*operands, 1e-6, True, interleaved, rows_per_tile=rows_per_tile)
        got = qk_norm_rope_backward(
            *grads, *operands, 1e-6, True, interleaved, programs_per_sm=1, rows_per_tile=rows_per_tile
        )
    for out, ref in zip((*fused, *got), (*expected, *want), strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
