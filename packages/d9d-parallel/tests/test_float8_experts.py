"""FP8 MoE experts: the rowwise quantization, the autograd around the grouped GEMMs, refusals.

The FP8 grouped GEMM runs on Hopper-or-newer GPUs; on CPU its reference runs (the same
quantization, the dequantized products in float32), so only the GEMM's accumulation differs. The
``gpu`` test compares the real kernels with that reference.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from d9d.parallel import Float8GroupedMatmul, convert_experts_to_float8, quantize_rowwise


def _plain_grouped_mm(x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
    groups = torch.split(x, tokens_per_group.tolist())
    return torch.cat([g @ w for g, w in zip(groups, weight, strict=True)])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_rowwise_quantization_uses_power_of_two_scales_and_stays_in_range() -> None:
    torch.manual_seed(0)
    t = torch.randn(6, 64) * torch.logspace(-3, 3, 6)[:, None]
    t[2] = 0.0  # an all-zero row gets a finite scale
    data, scale = quantize_rowwise(t, dim=1)
    assert data.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.isfinite(scale).all()
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale), "scales must be powers of two"
    assert data.float().abs().max() <= torch.finfo(torch.float8_e4m3fn).max
    restored = data.float() * scale
    nonzero = [0, 1, 3, 4, 5]
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself, every row's max near 448
    assert torch.allclose(restored[nonzero], t[nonzero], rtol=2**-4, atol=0)
    assert (data.float()[nonzero].abs().amax(dim=1) > 224).all(), "the scale should use the range"
    assert torch.equal(restored[2], t[2])


def test_forward_and_input_gradient_are_close_to_bf16_and_weight_gradient_is_bf16() -> None:
    torch.manual_seed(0)
    sizes = torch.tensor([3, 0, 21, 2, 37])  # uneven, an empty group, none a multiple of 16
    x = torch.randn(int(sizes.sum()), 32, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(5, 32, 48) * 32**-0.5).to(torch.bfloat16).requires_grad_()
    out = Float8GroupedMatmul()(x, weight, sizes)
    assert out.dtype == torch.bfloat16 and out.shape == (63, 48)
    reference = _plain_grouped_mm(x.float(), weight.float(), sizes)
    assert _relative(out, reference) < 0.06
    assert _relative(out, torch.randn_like(reference)) > 1  # the bound means something
    grad = torch.randn_like(reference)
    out.backward(grad.to(torch.bfloat16))
    want_x, want_w = torch.autograd.grad(reference, (x, weight), grad)
    assert x.grad is not None and weight.grad is not None
    assert _relative(x.grad, want_x) < 0.06
    # the weight gradient is a bf16 GEMM of the unquantized operands
    assert _relative(weight.grad, want_w) < 1e-2


def test_only_the_needed_gradients_are_computed() -> None:
    sizes = torch.tensor([16, 16])
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    weight = torch.randn(2, 32, 16, dtype=torch.bfloat16, requires_grad=True)
    Float8GroupedMatmul()(x, weight, sizes).sum().backward()
    assert weight.grad is not None and x.grad is None
    frozen = torch.randn(2, 32, 16, dtype=torch.bfloat16)
    x.requires_grad_()
    Float8GroupedMatmul()(x, frozen, sizes).sum().backward()
    assert x.grad is not None and frozen.grad is None


def test_compiled_equals_eager() -> None:
    # the ops are opaque to torch.compile: the compiled graph must give the eager values exactly
    torch.manual_seed(0)
    sizes = torch.tensor([5, 0, 27, 12])
    x = torch.randn(44, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(4, 32, 48) * 0.2).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(44, 48, dtype=torch.bfloat16)
    results = []
    for fn in (
        Float8GroupedMatmul(),
        torch.compile(Float8GroupedMatmul(), backend="aot_eager", fullgraph=True),
    ):
        x.grad = weight.grad = None
        out = fn(x, weight, sizes)
        out.backward(grad)
        assert x.grad is not None and weight.grad is not None
        results.append((out.detach(), x.grad, weight.grad))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)
    assert results[0][1].abs().sum() > 0 and results[0][2].abs().sum() > 0


def test_pair_casts_the_shared_input_once_and_matches_two_calls() -> None:
    torch.manual_seed(0)
    sizes = torch.tensor([3, 0, 21, 2, 37])
    x = torch.randn(int(sizes.sum()), 32, dtype=torch.bfloat16, requires_grad=True)
    weights = [(torch.randn(5, 32, 48) * 32**-0.5).to(torch.bfloat16).requires_grad_() for _ in range(2)]
    grads = [torch.randn(63, 48, dtype=torch.bfloat16) for _ in range(2)]
    matmul = Float8GroupedMatmul()
    pair = matmul.pair(x, weights[0], weights[1], sizes)
    torch.autograd.backward(pair, grads)
    assert x.grad is not None and weights[0].grad is not None and weights[1].grad is not None
    got_x, got_w = x.grad, [w.grad for w in weights]
    x.grad = weights[0].grad = weights[1].grad = None
    singles = [matmul(x, w, sizes) for w in weights]
    torch.autograd.backward(singles, grads)
    # the same quantization of x and of each weight: the products and weight gradients agree exactly
    for a, b in zip(pair, singles, strict=True):
        assert torch.equal(a, b)
    for got, want in zip(got_w, [w.grad for w in weights], strict=True):
        assert want is not None and torch.equal(got, want)
    # the input gradient is one GEMM over both (one scale per row across both gradients)
    assert x.grad is not None and _relative(got_x, x.grad) < 0.03
    reference = [_plain_grouped_mm(x.float(), w.float(), sizes) for w in weights]
    want_x = torch.autograd.grad(reference, x, [g.float() for g in grads])[0]
    assert _relative(got_x, want_x) < 0.06


def test_pair_computes_only_the_needed_gradients_and_compiles_to_the_eager_values() -> None:
    torch.manual_seed(0)
    sizes = torch.tensor([5, 0, 27, 12])
    x = torch.randn(44, 32, dtype=torch.bfloat16, requires_grad=True)
    frozen = (torch.randn(4, 32, 48) * 0.2).to(torch.bfloat16)
    weight = (torch.randn(4, 32, 48) * 0.2).to(torch.bfloat16).requires_grad_()
    grads = [torch.randn(44, 48, dtype=torch.bfloat16) for _ in range(2)]
    pair = Float8GroupedMatmul().pair
    results = []
    for fn in (pair, torch.compile(pair, backend="aot_eager", fullgraph=True)):
        x.grad = weight.grad = None
        out = fn(x, frozen, weight, sizes)
        torch.autograd.backward(out, grads)
        assert x.grad is not None and weight.grad is not None and frozen.grad is None
        results.append((*out, x.grad, weight.grad))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager.detach(), compiled.detach())
    assert results[0][2].abs().sum() > 0 and results[0][3].abs().sum() > 0


class _Experts(nn.Module):
    def __init__(self, k: int = 32, n: int = 48) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(4, k, n))
        self.grouped_matmul = _plain_grouped_mm
        self.shared_input_matmul = None

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.grouped_matmul(tokens, self.gate_proj, tokens_per_expert)


def test_float8_experts_install_the_fp8_grouped_gemm() -> None:
    experts = _Experts()
    reference = _Experts()
    reference.load_state_dict(experts.state_dict())
    convert_experts_to_float8(experts)
    assert isinstance(experts.grouped_matmul, Float8GroupedMatmul)
    assert experts.shared_input_matmul == experts.grouped_matmul.pair
    assert [name for name, _ in experts.named_parameters()] == ["gate_proj"]
    tokens = torch.randn(10, 32)
    sizes = torch.tensor([3, 0, 5, 2])
    assert _relative(experts(tokens, sizes), reference(tokens, sizes)) < 0.06


def test_float8_experts_refuse_unaligned_weights() -> None:
    with pytest.raises(ValueError, match=r"'gate_proj' of shape \(4, 32, 40\)"):
        convert_experts_to_float8(_Experts(n=40))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm90+"
)
@pytest.mark.parametrize("compiled", [False, True])
def test_real_kernels_match_the_reference_on_unaligned_groups(compiled: bool) -> None:
    torch.manual_seed(0)
    sizes = torch.tensor([1, 0, 300, 17, 1000, 5, 131, 0])
    x = torch.randn(int(sizes.sum()), 256, dtype=torch.bfloat16)
    weight = (torch.randn(8, 256, 512) * 256**-0.5).to(torch.bfloat16)
    grad = torch.randn(x.shape[0], 512, dtype=torch.bfloat16)

    def run(device: str, compile_it: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xd = x.to(device).requires_grad_()
        wd = weight.to(device).requires_grad_()
        fn = torch.compile(Float8GroupedMatmul()) if compile_it else Float8GroupedMatmul()
        out = fn(xd, wd, sizes.to(device))
        out.backward(grad.to(device))
        assert xd.grad is not None and wd.grad is not None
        return out.detach().cpu(), xd.grad.cpu(), wd.grad.cpu()

    got, want = run("cuda", compiled), run("cpu", False)
    errors = {
        name: _relative(a, b) for name, a, b in zip(("out", "grad x", "grad w"), got, want, strict=True)
    }
    # the same quantization on both sides: only the GEMMs' accumulation differs
    assert max(errors.values()) < 1e-2, errors
    fp32 = _plain_grouped_mm(x.float(), weight.float(), sizes)
    assert _relative(got[0], fp32) < 0.06


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm90+"
)
@pytest.mark.parametrize("compiled", [False, True])
def test_real_kernels_of_the_pair_match_the_reference(compiled: bool) -> None:
    torch.manual_seed(0)
    sizes = torch.tensor([1, 0, 300, 17, 1000, 5, 131, 0])
    x = torch.randn(int(sizes.sum()), 256, dtype=torch.bfloat16)
    weights = [(torch.randn(8, 256, 512) * 256**-0.5).to(torch.bfloat16) for _ in range(2)]
    grads = [torch.randn(x.shape[0], 512, dtype=torch.bfloat16) for _ in range(2)]

    def run(device: str, compile_it: bool) -> list[torch.Tensor]:
        xd = x.to(device).requires_grad_()
        wd = [w.to(device).requires_grad_() for w in weights]
        pair = Float8GroupedMatmul().pair
        fn = torch.compile(pair) if compile_it else pair
        out = fn(xd, wd[0], wd[1], sizes.to(device))
        torch.autograd.backward(out, [g.to(device) for g in grads])
        assert xd.grad is not None and wd[0].grad is not None and wd[1].grad is not None
        return [t.detach().cpu() for t in (*out, xd.grad, wd[0].grad, wd[1].grad)]

    got, want = run("cuda", compiled), run("cpu", False)
    names = ("out a", "out b", "grad x", "grad w a", "grad w b")
    errors = {name: _relative(a, b) for name, a, b in zip(names, got, want, strict=True)}
    assert max(errors.values()) < 1e-2, errors
