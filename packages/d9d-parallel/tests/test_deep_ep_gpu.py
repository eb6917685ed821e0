"""DeepEPTokenDispatcher on 2 GPUs (NCCL, DeepEP's NVLink kernels) against the all-to-all one.

The same MoE layer, parallelized twice over the same ep mesh (2 ranks), once per dispatcher,
runs forward and backward twice on the same tokens; outputs and the gradients of the input,
the router and the expert weights must agree within bfloat16 tolerance. DeepEP reduces
bfloat16 only, so float32 hidden states must be refused with a ValueError naming the dtype.
Ranks start under torchrun, never forked from pytest (see test_context_parallel_gpu.py).

    torchrun --nproc-per-node 2 test_deep_ep_gpu.py --experts 16

Needs DeepEP importable (scripts/build-deepep.sh builds it; its target folder on PYTHONPATH).
"""

import argparse
import copy
import functools
import importlib.util
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from d9d.parallel import DeepEPBuffers, DeepEPTokenDispatcher, parallelize_expert_parallel

pytestmark = pytest.mark.multi_gpu

HIDDEN, FFN, TOP_K, TOKENS = 512, 256, 8, 1024
TOLERANCE = {"atol": 3e-2, "rtol": 3e-2}


class Experts(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, HIDDEN, FFN) * HIDDEN**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, FFN, HIDDEN) * FFN**-0.5)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        groups = tokens.split(tokens_per_expert.tolist())
        return torch.cat([torch.tanh(g @ self.w_in[e]) @ self.w_out[e] for e, g in enumerate(groups)])


class MoE(nn.Module):
    """Fits the MoE slot; the router computes in float32, the rest in the parameters' dtype."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = experts, TOP_K
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.shared_expert = None
        self.experts = Experts(experts)
        self.dispatcher = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x.float())
        weights, indices = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        tokens, counts = self.dispatcher.dispatch(x, indices, weights)
        return self.dispatcher.combine(self.experts(tokens, counts))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).float()


def _compare(experts: int, device: torch.device) -> None:
    mesh = DeviceMesh("cuda", torch.arange(dist.get_world_size()), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    reference = MoE(experts).to(device=device, dtype=torch.bfloat16)
    reference.router.float()
    model = copy.deepcopy(reference)
    parallelize_expert_parallel(reference, mesh=mesh)
    parallelize_expert_parallel(model, mesh=mesh, dispatcher="deep_ep", deep_ep_buffers=DeepEPBuffers())
    assert isinstance(model.dispatcher, DeepEPTokenDispatcher)
    generator = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(TOKENS, HIDDEN, device=device, generator=generator, dtype=torch.bfloat16)
    grad = torch.randn(TOKENS, HIDDEN, device=device, generator=generator, dtype=torch.bfloat16)
    results = []
    for moe in (reference, model):
        for _ in range(2):  # the second step reuses DeepEP's buffer; gradients accumulate
            leaf = x.clone().requires_grad_(True)
            out = moe(leaf)
            out.backward(grad)
        grads = {name: _local(p.grad) for name, p in moe.named_parameters() if p.grad is not None}
        results.append((out.detach().float(), leaf.grad.float(), grads))
    (out_ref, x_ref, grads_ref), (out, x_grad, grads) = results
    torch.testing.assert_close(out, out_ref, **TOLERANCE, msg="output")
    torch.testing.assert_close(x_grad, x_ref, **TOLERANCE, msg="input gradient")
    assert grads.keys() == grads_ref.keys() == {"router.weight", "experts.w_in", "experts.w_out"}
    for name, expected in grads_ref.items():
        scale = expected.abs().max()
        torch.testing.assert_close(grads[name] / scale, expected / scale, **TOLERANCE, msg=name)

    indices = torch.zeros(TOKENS, TOP_K, dtype=torch.long, device=device)
    weights = torch.ones(TOKENS, TOP_K, device=device)
    with pytest.raises(ValueError, match=r"bfloat16 rows only; the hidden states are torch\.float32"):
        model.dispatcher.dispatch(x.float(), indices, weights)


def _rank_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, required=True)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    index = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=120))
    try:
        _compare(args.experts, device)
    finally:
        dist.destroy_process_group()


@functools.cache
def _two_gpus() -> bool:
    # In a child process, for the reason in test_context_parallel_gpu.py.
    probe = "import torch; print(torch.cuda.device_count() >= 2)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    return done.stdout.strip() == "True"


@pytest.mark.parametrize(
    "experts",
    [
        16,  # top-8 of 16: 8 experts per rank, most tokens reach both ranks
        64,  # top-8 of 64: 32 experts per rank
    ],
)
def test_deep_ep_matches_all_to_all_on_two_gpus(experts: int) -> None:
    if importlib.util.find_spec("deep_ep") is None:
        pytest.skip("needs DeepEP (scripts/build-deepep.sh)")
    if not _two_gpus():
        pytest.skip("needs 2 CUDA GPUs")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        __file__, "--experts", str(experts),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]


if __name__ == "__main__":
    _rank_main()
