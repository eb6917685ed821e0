"""RMSNorm variants."""

import os

import pytest
import torch

from d9d.kernels import KernelBackend, add_rms_norm, rms_norm, rms_norm_add
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


def _stream(rows: int, width: int, dtype: torch.dtype, device: str = "cpu"):
    generator = torch.Generator().manual_seed(rows * 100 + width)
    residual, branch = (torch.randn(rows, width, generator=generator).to(device, dtype) for _ in range(2))
    weight = torch.randn(width, generator=generator).to(device, dtype)
    return residual, branch, weight


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero-centered"])
def test_one_kernel_adds_then_normalizes_the_rounded_sum(
    rows: int, dtype: torch.dtype, zero_centered: bool
) -> None:
    residual, branch, weight = _stream(rows, 48, dtype)  # 48: the padded block's columns are masked
    total, normed = add_rms_norm(
        residual, branch, weight, 1e-5, zero_centered_weight=zero_centered, backend=KernelBackend.TRITON
    )
    # Triton's interpreter truncates conversions to bf16 (a unit in the last place); the GPU rounds as
    # torch does, and its test asserts equality
    torch.testing.assert_close(total, residual + branch, rtol=torch.finfo(dtype).eps, atol=0)
    expected = rms_norm(
        residual + branch, weight, 1e-5, zero_centered_weight=zero_centered, backend=KernelBackend.REFERENCE
    )
    torch.testing.assert_close(normed, expected)


def test_add_rms_norm_refuses_a_branch_of_another_shape() -> None:
    residual, branch, weight = _stream(2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"branch \(2, 4\) torch.float32 must match the residual \(2, 8\)"):
        add_rms_norm(residual, branch[:, :4], weight)


def test_the_layer_adds_and_normalizes_as_its_forward_with_and_without_gradients() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    residual, branch = torch.randn(3, 8), torch.randn(3, 8, requires_grad=True)
    total, normed = norm.add_and_normalize(residual, branch)
    normed.sum().backward()  # with gradients: the add and forward, differentiable
    torch.testing.assert_close(total.detach(), residual + branch.detach())
    assert branch.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        fused = norm.add_and_normalize(residual, branch)
        torch.testing.assert_close(fused[0], residual + branch)
        torch.testing.assert_close(fused[1], norm(residual + branch))
    torch.testing.assert_close(normed.detach(), fused[1])


def test_a_hooked_norm_adds_and_runs_its_forward() -> None:
    calls: list[str] = []
    norm = RMSNorm(8)
    norm.register_forward_pre_hook(lambda *_: calls.append("pre-hook"))
    with torch.no_grad():
        norm.add_and_normalize(torch.randn(2, 8), torch.randn(2, 8))
    assert calls == ["pre-hook"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("rows", "width"), [(1, 1024), (64, 1024), (64, 4096)])
def test_add_rms_norm_at_decode_shapes_on_gpu(rows: int, width: int) -> None:
    residual, branch, weight = _stream(rows, width, torch.bfloat16, "cuda")
    total, normed = add_rms_norm(residual, branch, weight, 1e-6)
    assert torch.equal(total, residual + branch)
    torch.testing.assert_close(normed, rms_norm(residual + branch, weight, 1e-6))


def _post_norms(width: int, device: str = "cpu") -> tuple[RMSNorm, RMSNorm]:
    torch.manual_seed(width)
    after, then = RMSNorm(width, eps=1e-6, zero_centered_weight=True), RMSNorm(width, eps=1e-5)
    with torch.no_grad():
        after.weight.normal_(std=0.1)
        then.weight.normal_(mean=1.0, std=0.1)
    return after.to(device), then.to(device)


@pytest.mark.parametrize("then", [False, True], ids=["add", "add-then-norm"])
def test_normalize_and_add_equals_the_norm_the_add_and_the_next_norm(then: bool) -> None:
    after, following = _post_norms(24)
    residual = torch.randn(2, 3, 24, requires_grad=True)
    branch = torch.randn(2, 3, 24, requires_grad=True)
    total, normed = after.normalize_and_add(residual, branch, scale=0.5, then=following if then else None)
    expected_total = residual + 0.5 * after(branch)
    expected_normed = following(expected_total) if then else expected_total
    torch.testing.assert_close(total, expected_total)
    torch.testing.assert_close(normed, expected_normed)
    upstream = torch.randn(2, 3, 24), torch.randn(2, 3, 24)
    params = [residual, branch, after.weight, following.weight] if then else [residual, branch, after.weight]
    grads = torch.autograd.grad((total, normed), params, upstream)
    expected = torch.autograd.grad((expected_total, expected_normed), params, upstream)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_normalize_and_add_runs_hooked_norms_through_their_forward() -> None:
    after, following = _post_norms(8)
    calls: list[str] = []
    following.register_forward_pre_hook(lambda *_: calls.append("then"))
    after.register_forward_pre_hook(lambda *_: calls.append("after"))
    after.normalize_and_add(torch.randn(2, 8), torch.randn(2, 8), then=following)
    assert calls == ["after", "then"]


def test_rms_norm_add_names_the_weight_that_does_not_fit() -> None:
    residual, branch, weight = _stream(2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"next_weight shape \(4,\) does not match"):
        rms_norm_add(residual, branch, weight, next_weight=weight[:4])
    with pytest.raises(ValueError, match=r"branch \(2, 4\) torch.float32 must match the residual \(2, 8\)"):
        rms_norm_add(residual, branch[:, :4], weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("then", [False, True], ids=["add", "add-then-norm"])
def test_compiled_normalize_and_add_runs_the_kernels_and_matches_eager(then: bool) -> None:
    after, following = _post_norms(1152, "cuda")
    after, following = after.bfloat16(), following.bfloat16()
    residual = torch.randn(4, 512, 1152, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    branch = torch.randn(4, 512, 1152, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def junction(r: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return after.normalize_and_add(r, b, then=following if then else None)

    upstream = torch.randn_like(residual), torch.randn_like(residual)
    params = [residual, branch, after.weight, *([following.weight] if then else [])]
    eager = junction(residual, branch)
    eager_grads = torch.autograd.grad(eager, params, upstream)
    compiled = torch.compile(junction, fullgraph=True)(residual, branch)  # the custom op traces
    compiled_grads = torch.autograd.grad(compiled, params, upstream)
    for got, want in zip((*compiled, *compiled_grads), (*eager, *eager_grads), strict=True):
        assert torch.equal(got, want)  # the same kernels run either way


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("then", [False, True], ids=["add", "add-then-norm"])
def test_compiled_rms_norm_add_traces_the_custom_op_and_matches_eager(then: bool) -> None:
    residual, branch, weight = (t.requires_grad_() for t in _stream(5, 24, torch.float32))
    next_weight = (weight.detach() * 0.1 + 1).requires_grad_()

    def junction(
        r: torch.Tensor, b: torch.Tensor, w: torch.Tensor, nw: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        total, normed = rms_norm_add(
            r, b, w, zero_centered_weight=True, scale=0.5, next_weight=nw if then else None,
            backend=KernelBackend.TRITON,
        )  # fmt: skip
        return (total,) if normed is None else (total, normed)

    params = [residual, branch, weight, *([next_weight] if then else [])]
    upstream = (torch.randn(5, 24), torch.randn(5, 24))[: 2 if then else 1]
    eager = junction(residual, branch, weight, next_weight)
    compiled = torch.compile(junction, fullgraph=True)(residual, branch, weight, next_weight)
    eager_grads = torch.autograd.grad(eager, params, upstream)
    compiled_grads = torch.autograd.grad(compiled, params, upstream)
    for got, want in zip((*compiled, *compiled_grads), (*eager, *eager_grads), strict=True):
        assert torch.equal(got, want)  # the same kernels, as one custom op each way


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_rms_norm_add_backward_without_the_next_norms_gradient() -> None:
    # the stream used, the next norm's output not: its gradient never arrives
    residual, branch, weight = (t.requires_grad_() for t in _stream(7, 40, torch.float32))
    next_weight = (weight.detach() + 1).requires_grad_()
    grads = {}
    for backend in (KernelBackend.TRITON, KernelBackend.REFERENCE):
        total, _ = rms_norm_add(residual, branch, weight, next_weight=next_weight, backend=backend)
        grads[backend] = torch.autograd.grad(total.square().sum(), [residual, branch, weight])
    for got, want in zip(grads[KernelBackend.TRITON], grads[KernelBackend.REFERENCE], strict=True):
        torch.testing.assert_close(got, want)
