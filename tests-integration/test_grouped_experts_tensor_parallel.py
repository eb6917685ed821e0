"""d9d-parallel's grouped tensor parallelism applied to d9d-kernels' grouped SwiGLU experts."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from d9d.kernels.layers import GroupedSwiGLUExperts
from d9d.mesh.testing import run_distributed
from d9d.parallel import parallelize_grouped_tensor_parallel


def _run(tp: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    experts = GroupedSwiGLUExperts(num_experts=4, hidden_size=16, intermediate_size=24)
    experts.reset_parameters()
    if tp:
        mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()), mesh_dim_names=("tp",))
        parallelize_grouped_tensor_parallel(experts, mesh=mesh)
    tokens = torch.randn(10, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    counts = torch.tensor([4, 0, 1, 5])
    out = experts(tokens, counts)
    out.square().sum().backward()
    result = {"out": out.detach(), "tokens_grad": tokens.grad}
    for name, p in experts.named_parameters():
        grad = p.grad
        result[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach()
    return result


def test_kernels_grouped_experts_under_tensor_parallelism() -> None:
    reference = run_distributed(_run, False, world_size=1)[0]
    for result in run_distributed(_run, True, world_size=2, timeout_s=120):
        for key, value in reference.items():
            torch.testing.assert_close(result[key], value, rtol=1e-5, atol=1e-5, msg=key)
