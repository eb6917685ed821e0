"""Context-parallel attention on CUDA tensors over gloo, against full-sequence attention.

The ranks run in fresh processes started by torchrun, never forked from pytest: by the time a
``gpu`` test runs, the pytest process has usually asked ``torch.cuda.is_available()`` (d9d-kernels'
conftest and the ``skipif`` of other GPU test modules, at collection), which initializes the CUDA
driver, and the ranks that ``d9d.mesh.testing`` forks after that (from its zygote, itself forked
after collection) fail at their first CUDA call with "CUDA error: initialization error". Alone,
this module passed; in ``pytest -m gpu`` with the other GPU modules, both cases failed.

    torchrun --nproc-per-node 2 test_context_parallel_gpu.py --dtype float32 [--device cuda]
"""

import argparse
import functools
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from d9d.parallel import ContextParallelAttention, context_parallel_shard, context_parallel_unshard

pytestmark = pytest.mark.gpu

_TOLERANCES = {
    "float32": {"atol": 1e-4, "rtol": 1e-4},
    "bfloat16": {"atol": 3e-2, "rtol": 3e-2},
}


def _reference(query, key, value, *, causal, sliding_window, document_ids, scale):
    # d9d-kernels' mask: j <= i when causal, |i - j| < w with a window, same document
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


def _on_device(
    device: torch.device,
    dtype: torch.dtype,
    causal: bool,
    sliding_window: int | None,
    one_document: bool,
    tolerance: dict,
) -> None:
    # gloo moves the CUDA tensors (CUDA all-gather and all-reduce); a rank per GPU where there
    # are several, else the ranks share one.
    mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()), mesh_dim_names=("cp",))
    generator = torch.Generator(device=device).manual_seed(0)
    batch, seq, q_heads, kv_heads, dim = 2, 256, 8, 2, 64
    q = torch.randn(batch, seq, q_heads, dim, device=device, generator=generator, dtype=dtype)
    k = torch.randn(batch, seq, kv_heads, dim, device=device, generator=generator, dtype=dtype)
    v = torch.randn(batch, seq, kv_heads, dim, device=device, generator=generator, dtype=dtype)
    grad_out = torch.randn(batch, seq, q_heads, dim, device=device, generator=generator, dtype=dtype)
    documents = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if not one_document:
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
        # One document per row is stated as None: plain causal attention, the cuDNN block path.
        document_ids=None if one_document else context_parallel_shard(documents, mesh=mesh),
    )
    assert out.device == device and out.dtype == dtype
    out.backward(context_parallel_shard(grad_out, mesh=mesh))
    torch.testing.assert_close(
        context_parallel_unshard(out.detach(), mesh=mesh).float(), expected.detach(), **tolerance
    )
    for name, mine, ref in zip("qkv", local, full, strict=True):
        gathered = context_parallel_unshard(mine.grad, mesh=mesh).float()
        torch.testing.assert_close(gathered, ref.grad.float(), **tolerance, msg=f"grad {name}")


def _rank_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=sorted(_TOLERANCES), required=True)
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--bidirectional", action="store_true")  # not causal
    parser.add_argument("--one-document", action="store_true")  # no document ids
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")  # cpu: the plumbing only
    args = parser.parse_args()
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        index = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        _on_device(
            device,
            getattr(torch, args.dtype),
            not args.bidirectional,
            args.sliding_window,
            args.one_document,
            _TOLERANCES[args.dtype],
        )
    finally:
        dist.destroy_process_group()


@functools.cache
def _cuda_available() -> bool:
    # In a child process, for the reason in the module docstring.
    probe = "import torch; print(torch.cuda.is_available())"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    return done.stdout.strip() == "True"


@pytest.mark.parametrize(
    ("dtype", "causal", "sliding_window", "one_document"),
    [
        ("float32", True, None, False),  # fp32 causal with packed documents
        ("bfloat16", True, 64, False),  # bf16 with a causal sliding window
        ("bfloat16", False, 64, False),  # bf16 with a two-sided sliding window (not causal)
        ("bfloat16", True, None, True),  # bf16 plain causal: cuDNN blocks merged by log-sum-exp
        ("float32", True, None, True),  # fp32 plain causal: the lower-right causal bias
    ],
)
def test_context_parallel_attention_on_gpu(
    dtype: str, causal: bool, sliding_window: int | None, one_document: bool
) -> None:
    if not _cuda_available():
        pytest.skip("needs a CUDA GPU")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        __file__, "--dtype", dtype,
    ]  # fmt: skip
    if sliding_window is not None:
        command += ["--sliding-window", str(sliding_window)]
    if not causal:
        command += ["--bidirectional"]
    if one_document:
        command += ["--one-document"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]


if __name__ == "__main__":
    _rank_main()
