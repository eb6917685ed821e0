import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from d9d.mesh.testing import run_distributed
from d9d.parallel import ContextParallelAttention, context_parallel_shard, context_parallel_unshard

pytestmark = pytest.mark.gpu


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _skip_without_cuda() -> None:
    # Asked in a forked child: CUDA initialized in this process would break every later fork.
    if not run_distributed(_cuda_available, world_size=1)[0]:
        pytest.skip("needs a CUDA GPU")


def _reference(query, key, value, *, causal, sliding_window, document_ids, scale):
    seq = query.shape[1]
    i = torch.arange(seq, device=query.device).unsqueeze(1)
    j = torch.arange(seq, device=query.device).unsqueeze(0)
    mask = ((j <= i) | (not causal)).unsqueeze(0)
    if sliding_window is not None:
        mask = mask & ((i - j).abs() < sliding_window)
    mask = mask & (document_ids.unsqueeze(2) == document_ids.unsqueeze(1))
    repeat = query.shape[2] // key.shape[2]
    q = query.transpose(1, 2).float()
    k = key.repeat_interleave(repeat, 2).transpose(1, 2).float()
    v = value.repeat_interleave(repeat, 2).transpose(1, 2).float()
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _on_gpu(dtype, causal, sliding_window, tolerance) -> None:
    # Ranks share the one GPU; gloo moves the CUDA tensors (CUDA all-gather and all-reduce).
    device = torch.device("cuda", 0)
    mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()), mesh_dim_names=("cp",))
    generator = torch.Generator(device=device).manual_seed(0)
    batch, seq, q_heads, kv_heads, dim = 2, 256, 8, 2, 64
    q = torch.randn(batch, seq, q_heads, dim, device=device, generator=generator, dtype=dtype)
    k = torch.randn(batch, seq, kv_heads, dim, device=device, generator=generator, dtype=dtype)
    v = torch.randn(batch, seq, kv_heads, dim, device=device, generator=generator, dtype=dtype)
    grad_out = torch.randn(batch, seq, q_heads, dim, device=device, generator=generator, dtype=dtype)
    documents = torch.zeros(batch, seq, dtype=torch.long, device=device)
    documents[0, 100:] = 1
    scale = dim**-0.5

    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = _reference(
        *full, causal=causal, sliding_window=sliding_window, document_ids=documents, scale=scale
    )
    expected.backward(grad_out.float())

    local = [context_parallel_shard(t, mesh=mesh).requires_grad_(True) for t in (q, k, v)]
    out = ContextParallelAttention(mesh=mesh).attend(
        *local,
        causal=causal,
        softmax_scale=scale,
        sliding_window=sliding_window,
        document_ids=context_parallel_shard(documents, mesh=mesh),
    )
    assert out.device.type == "cuda" and out.dtype == dtype
    out.backward(context_parallel_shard(grad_out, mesh=mesh))
    torch.testing.assert_close(
        context_parallel_unshard(out.detach(), mesh=mesh).float(), expected.detach(), **tolerance
    )
    for name, mine, ref in zip("qkv", local, full, strict=True):
        gathered = context_parallel_unshard(mine.grad, mesh=mesh).float()
        torch.testing.assert_close(gathered, ref.grad.float(), **tolerance, msg=f"grad {name}")


@pytest.mark.parametrize(
    ("dtype", "causal", "sliding_window", "tolerance"),
    [
        (torch.float32, True, None, {"atol": 1e-4, "rtol": 1e-4}),  # fp32 causal with packed documents
        (torch.bfloat16, True, 64, {"atol": 3e-2, "rtol": 3e-2}),  # bf16 with a causal sliding window
        (torch.bfloat16, False, 64, {"atol": 3e-2, "rtol": 3e-2}),  # bf16, two-sided sliding window
    ],
)
def test_context_parallel_attention_on_gpu(dtype, causal, sliding_window, tolerance) -> None:
    _skip_without_cuda()
    run_distributed(_on_gpu, dtype, causal, sliding_window, tolerance, world_size=2, timeout_s=300)
