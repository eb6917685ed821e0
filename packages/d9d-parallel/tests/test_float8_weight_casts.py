"""Float8 casts of expert weights kept across microbatches (``Float8WeightCasts``).

Every case compares with the FP8 experts casting per call: kept casts must give the same values bit
for bit, be recomputed when the weights change (a step, an in-place write, ``clear``) and never
outlive the tensors they were cast from. On CPU the reference GEMM runs, with the same casts.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from d9d.parallel import Float8GroupedMatmul, Float8WeightCasts

SIZES = torch.tensor([5, 0, 27, 12])
HIDDEN, WIDTH, EXPERTS = 32, 48, 4


def _weights(seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    torch.manual_seed(seed)
    shapes = [(EXPERTS, HIDDEN, WIDTH), (EXPERTS, HIDDEN, WIDTH), (EXPERTS, WIDTH, HIDDEN)]
    return [(torch.randn(shape) * 0.2).to(device, torch.bfloat16).requires_grad_() for shape in shapes]


def _microbatches(count: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    rows = int(SIZES.sum())
    return [
        (
            torch.randn(rows, HIDDEN, dtype=torch.bfloat16).to(device),
            torch.randn(rows, HIDDEN, dtype=torch.bfloat16).to(device),
        )
        for _ in range(count)
    ]


def _swiglu(matmul: Float8GroupedMatmul, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    sizes = SIZES.to(x.device)
    gate, up = matmul.pair(x, weights[0], weights[1], sizes)
    return matmul(F.silu(gate) * up, weights[2], sizes)


def _accumulate(
    matmul: Float8GroupedMatmul, weights: list[torch.Tensor], count: int, device: str = "cpu"
) -> list[torch.Tensor]:
    """Outputs and the input gradients of ``count`` microbatches, gradients accumulated in ``weights``."""
    results: list[torch.Tensor] = []
    for tokens, upstream in _microbatches(count, device):
        x = tokens.requires_grad_()
        out = _swiglu(matmul, x, weights)
        out.backward(upstream)
        assert x.grad is not None
        results += [out.detach(), x.grad]
    return results


def test_kept_casts_give_the_per_call_values_bit_for_bit_and_are_cast_once() -> None:
    fresh, kept = _weights(), _weights()
    casts = Float8WeightCasts()
    want = _accumulate(Float8GroupedMatmul(), fresh, 3)
    got = _accumulate(Float8GroupedMatmul(casts), kept, 3)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kept, fresh, strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    # two lookups per microbatch (gate and up as one, down): cast in the first, kept after
    assert (casts.misses, casts.hits, len(casts)) == (2, 4, 2)


def test_an_optimizer_step_in_place_recasts_the_weights() -> None:
    fresh, kept = _weights(), _weights()
    casts = Float8WeightCasts()
    optimizers = [torch.optim.SGD(w, lr=0.5) for w in (fresh, kept)]
    for _ in range(2):
        want = _accumulate(Float8GroupedMatmul(), fresh, 2)
        got = _accumulate(Float8GroupedMatmul(casts), kept, 2)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    # the step's in-place update bumps the version counters: the second step cast again
    assert casts.misses == 4 and casts.hits == 4
    assert not torch.equal(fresh[0], _weights()[0]), "the step must have changed the weights"


def test_clear_recasts_weights_changed_behind_the_version_counter() -> None:
    # FSDP gathers new values into the same unsharded tensors with their version kept: the
    # counter cannot tell, clear() after the step must
    weights = _weights()
    casts = Float8WeightCasts()
    matmul = Float8GroupedMatmul(casts)
    x = _microbatches(1)[0][0]
    before = _swiglu(matmul, x, weights).detach()
    new = _weights(seed=7)
    for weight, value in zip(weights, new, strict=True):
        weight.data.copy_(value.detach())  # .data: the version counter stays
    stale = _swiglu(matmul, x, weights).detach()
    assert torch.equal(stale, before), "a write that keeps the version is invisible without clear"
    casts.clear()
    assert len(casts) == 0
    got = _swiglu(matmul, x, weights).detach()
    assert torch.equal(got, _swiglu(Float8GroupedMatmul(), x, new).detach())


def test_weights_cast_anew_each_forward_never_hit_and_their_casts_go_with_them() -> None:
    # float32 parameters cast to bf16 for each forward (one rank without FSDP): new tensors
    masters = [w.detach().float().requires_grad_() for w in _weights()]
    casts = Float8WeightCasts()
    matmul = Float8GroupedMatmul(casts)
    for x, upstream in _microbatches(2):
        _swiglu(matmul, x, [m.to(torch.bfloat16) for m in masters]).backward(upstream)
    gc.collect()
    assert casts.hits == 0 and casts.misses == 4
    assert len(casts) == 0, "the casts of dead copies must not be kept"
    assert all(m.grad is not None and m.grad.abs().sum() > 0 for m in masters)


def test_casts_made_in_inference_mode_are_not_kept_for_training() -> None:
    # an evaluation under inference_mode between steps must not leave casts that a training
    # forward would then save for backward (inference tensors cannot be)
    weights = _weights()
    casts = Float8WeightCasts()
    matmul = Float8GroupedMatmul(casts)
    x, upstream = _microbatches(1)[0]
    with torch.inference_mode():
        evaluated = _swiglu(matmul, x, weights)
    assert len(casts) == 0 and casts.misses == 0
    trained = _swiglu(matmul, x, weights)
    trained.backward(upstream)
    assert torch.equal(trained.detach(), evaluated)
    assert casts.misses == 2 and all(w.grad is not None for w in weights)


def test_compiled_with_kept_casts_equals_eager() -> None:
    weights = _weights()
    results: list[list[torch.Tensor]] = []
    for compiled in (False, True):
        casts = Float8WeightCasts()
        matmul = Float8GroupedMatmul(casts)

        def step(x: torch.Tensor, matmul: Float8GroupedMatmul = matmul) -> torch.Tensor:
            return _swiglu(matmul, x, weights)

        fn = torch.compile(step, backend="aot_eager") if compiled else step
        outputs: list[torch.Tensor] = []
        for w in weights:
            w.grad = None
        for tokens, upstream in _microbatches(2):
            x = tokens.requires_grad_()
            out = fn(x)
            out.backward(upstream)
            assert x.grad is not None
            outputs += [out.detach(), x.grad]
        outputs += [w.grad for w in weights if w.grad is not None]
        assert casts.hits == 2, "the second microbatch reads the kept casts, compiled too"
        results.append(outputs)
    assert len(results[0]) == len(results[1]) == 7
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm90+"
)
def test_kept_casts_of_the_cuda_kernels_give_the_per_call_values_bit_for_bit() -> None:
    # on CUDA the casts are the one-pass Triton kernels and the GEMM is _scaled_grouped_mm
    fresh, kept = _weights(device="cuda"), _weights(device="cuda")
    casts = Float8WeightCasts()
    want = _accumulate(Float8GroupedMatmul(), fresh, 3, "cuda")
    got = _accumulate(Float8GroupedMatmul(casts), kept, 3, "cuda")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kept, fresh, strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    assert (casts.misses, casts.hits) == (2, 4)
