import math

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from d9d.mesh.testing import run_distributed
from d9d.parallel import clip_grad_norm, gradient_clip


def _distributed_params(fulls, mesh, placements) -> list[nn.Parameter]:
    params = []
    for full, placement in zip(fulls, placements, strict=True):
        p = nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, placement))
        p.grad = distribute_tensor(full, mesh, placement)
        params.append(p)
    return params


def _check_clipping(params, reference, norm_type, pp_group) -> None:
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5, norm_type=norm_type)
    norm = clip_grad_norm(params, 0.5, norm_type=norm_type, pp_group=pp_group)
    torch.testing.assert_close(norm, expected)
    for p, r in zip(params, reference, strict=False):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, r.grad)
    # Only computing the norm leaves gradients alone; it is now at most max_norm.
    again = clip_grad_norm(params, None, norm_type=norm_type, pp_group=pp_group)
    torch.testing.assert_close(again, torch.clamp(expected, max=0.5), atol=1e-5, rtol=1e-5)


def _reference(grads) -> list[nn.Parameter]:
    reference = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for r, g in zip(reference, grads, strict=True):
        r.grad = g.clone()
    return reference


def _mixed_placements(norm_type: float) -> None:
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    generator = torch.Generator().manual_seed(7)
    fulls = [torch.randn(6, 5, generator=generator) for _ in range(4)]
    placements = [
        (Shard(0), Replicate()),  # FSDP-like
        (Shard(0), Shard(1)),  # FSDP + TP
        (Replicate(), Replicate()),  # replicated: counted once
        (Replicate(), Shard(1)),  # TP only (5 columns: uneven over 2)
    ]
    params = _distributed_params(fulls, mesh, placements)
    plain = nn.Parameter(torch.zeros(3))
    plain.grad = torch.randn(3, generator=generator)
    params.append(plain)
    _check_clipping(params, _reference([*fulls, plain.grad]), norm_type, None)


def _pipeline_stages(norm_type: float) -> None:
    # pp=2 x tp=2: each stage holds its own parameters, sharded over its tp ranks.
    layout = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("pp", "tp"))
    stage = layout.get_local_rank("pp")
    tp_mesh = layout["tp"]
    generator = torch.Generator().manual_seed(3)
    stage_fulls = [[torch.randn(4, 3, generator=generator) for _ in range(2)] for _ in range(2)]
    params = _distributed_params(stage_fulls[stage], tp_mesh, [(Shard(0),), (Replicate(),)])
    all_grads = stage_fulls[0] + stage_fulls[1]
    # The reference holds both stages; this rank checks its own stage's clipped gradients.
    reference = _reference(all_grads)
    mine = reference[2 * stage : 2 * stage + 2]
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5, norm_type=norm_type)
    norm = clip_grad_norm(params, 0.5, norm_type=norm_type, pp_group=layout.get_group("pp"))
    torch.testing.assert_close(norm, expected)
    for p, r in zip(params, mine, strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad)


# The p-norms checked, in one world each (starting ranks costs more than the checks):
NORM_TYPES = (
    2.0,  # the usual L2 norm
    1.0,  # L1: sums of absolute values
    math.inf,  # max norm: MAX reductions
)


def _all_norm_types(check) -> None:
    for norm_type in NORM_TYPES:
        check(norm_type)


def test_norm_counts_each_gradient_once_across_mixed_placements() -> None:
    run_distributed(_all_norm_types, _mixed_placements, world_size=4, timeout_s=120)


def test_norm_adds_pipeline_stages() -> None:
    run_distributed(_all_norm_types, _pipeline_stages, world_size=4, timeout_s=120)


def _partial_refused() -> None:
    mesh = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("dp",))
    p = nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Replicate()]))
    p.grad = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"Partial.*\('dp',\).*GradientSynchronizer"):
        clip_grad_norm([p], 1.0)


def test_partial_gradients_are_refused() -> None:
    run_distributed(_partial_refused, world_size=2, timeout_s=120)


def test_excluded_duplicates_leave_the_norm_and_are_clipped_alike() -> None:
    # A tied weight's second copy (same gradient) must not count twice, yet gets the same factor.
    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(4, 3, generator=generator) for _ in range(2)]
    reference = _reference(grads)
    params = _reference(grads)
    duplicate = nn.Parameter(torch.zeros(4, 3))
    duplicate.grad = grads[0].clone()
    torch.nn.utils.clip_grad_norm_(reference, 0.5)
    norm = clip_grad_norm([*params, duplicate], 0.5, grad_scale=2.0, exclude_from_norm=[duplicate])
    torch.testing.assert_close(norm, 2.0 * torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    # clipped from twice the gradients to 0.5: the same gradients as clipping the originals
    torch.testing.assert_close(params[0].grad, reference[0].grad)
    torch.testing.assert_close(duplicate.grad, reference[0].grad)


@pytest.mark.parametrize("max_norm", [None, 0.5, 100.0])
def test_a_tensor_grad_scale_equals_the_same_float(max_norm: float | None) -> None:
    # The loop passes the loss-weight correction as a device scalar, never read on the host.
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(5, 2, generator=generator) for _ in range(3)]
    with_float, with_tensor = _reference(grads), _reference(grads)
    norm_float = clip_grad_norm(with_float, max_norm, grad_scale=0.25)
    norm_tensor = clip_grad_norm(with_tensor, max_norm, grad_scale=torch.tensor(0.25, dtype=torch.float64))
    assert norm_tensor.dtype == torch.float32
    torch.testing.assert_close(norm_tensor, norm_float)
    for a, b in zip(with_float, with_tensor, strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert not torch.equal(with_tensor[0].grad, grads[0]), "the scale must reach the gradients"


@pytest.mark.parametrize(("max_norm", "grad_scale"), [(0.5, 1.0), (0.5, 3.0), (100.0, 1.0), (None, 2.0)])
def test_gradient_clip_leaves_gradients_and_its_factor_does_what_clipping_does(
    max_norm: float | None, grad_scale: float
) -> None:
    # For optimizers that apply the factor themselves: same norm, gradients untouched, and the
    # factor applied afterwards gives the gradients clip_grad_norm leaves.
    generator = torch.Generator().manual_seed(11)
    grads = [torch.randn(4, 3, generator=generator), torch.randn(7, generator=generator)]
    clipped, deferred = _reference(grads), _reference(grads)
    norm = clip_grad_norm(clipped, max_norm, grad_scale=grad_scale)
    clip = gradient_clip(deferred, max_norm, grad_scale=grad_scale)
    torch.testing.assert_close(clip.norm, norm)
    for param, grad in zip(deferred, grads, strict=True):
        assert torch.equal(param.grad, grad)
    assert clip.factor is not None and clip.factor.shape == ()
    clip.apply()
    for a, b in zip(deferred, clipped, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_gradient_clip_without_scale_or_clipping_has_no_factor() -> None:
    params = _reference([torch.ones(3)])
    clip = gradient_clip(params, None)
    assert clip.factor is None
    torch.testing.assert_close(clip.norm, torch.tensor(3.0**0.5))


def _stage_without_gradients() -> list[float]:
    # Stage 1 has no gradient yet: it must still join the pipeline reduction (a rank that skips
    # it leaves the other waiting forever).
    group = torch.distributed.group.WORLD
    param = nn.Parameter(torch.zeros(3))
    if torch.distributed.get_rank() == 0:
        param.grad = torch.tensor([3.0, 0.0, 4.0])
    norm = clip_grad_norm([param], 1.0, pp_group=group)
    return [float(norm)]


def test_a_stage_without_gradients_still_joins_the_pipeline_reduction() -> None:
    assert run_distributed(_stage_without_gradients, world_size=2, timeout_s=60) == [[5.0], [5.0]]


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("own_kernel_elements", [1, 20, 10**9])
def test_sum_of_powers_is_the_same_with_large_tensors_reduced_alone(
    norm_type: float, own_kernel_elements: int
) -> None:
    # Large gradients get one reduction each, small ones one multi-tensor norm: whichever way a
    # tensor goes, the sum of |x|^p is that of the float64 values (bf16 ones read in float32).
    from d9d.parallel._grad_norm import _sum_of_powers

    generator = torch.Generator().manual_seed(11)
    tensors = [
        torch.randn(4, 6, generator=generator),
        torch.randn(3, generator=generator).to(torch.bfloat16),
        torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        torch.randn(2, 2, generator=generator),
    ]
    value = _sum_of_powers(tensors, norm_type, own_kernel_elements)
    expected = sum(float((t.double().abs() ** norm_type).sum()) for t in tensors)
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx(expected, rel=1e-5)
