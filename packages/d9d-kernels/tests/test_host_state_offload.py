"""StochasticAdamW with its moments in host memory equals the on-device optimizer, step for step.

On CPU the "device" and the host are the same memory, but the offloaded path still runs in full:
moments are allocated apart from the parameters, copied into the streamer's scratch chunk by
chunk, stepped there and copied back (the stream-less fallback of the CUDA path).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from d9d.kernels import HostStateOffload, KernelBackend, StochasticAdamW
from d9d.kernels._host_state import StreamedOperands, plan_chunks

_SHAPES = [(8, 6), (6,), (5, 4), (3, 3, 2)]


_DEVICES = [
    pytest.param("cpu", id="cpu"),  # the stream-less path, PyTorch reference step
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),  # pinned host moments, copy streams, the fused Triton step
]


def _params(dtype: torch.dtype, device: str = "cpu") -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(device, dtype)) for shape in _SHAPES
    ]


def _run(
    params: list[torch.nn.Parameter], optimizer: StochasticAdamW, *, steps: int, clip: bool, microbatches: int
) -> None:
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the rounding seeds come from the default generator
    for _ in range(steps):
        for _ in range(microbatches):  # gradient accumulation: the gradients of several backwards add up
            noise = [torch.randn(p.shape, generator=generator).to(p.device) for p in params]
            loss = sum((p.float() * n).sum() for p, n in zip(params, noise, strict=True))
            assert isinstance(loss, torch.Tensor)
            loss.backward()
        if clip:
            optimizer.step_with_gradient_scale(torch.tensor([0.37], device=params[0].device))
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("dtype", "state_dtype", "chunk_bytes", "resident_bytes"),
    [
        # bf16 parameters and moments, stochastic rounding everywhere; several parameters per chunk
        (torch.bfloat16, torch.bfloat16, 200, 0),
        # bf16 parameters, fp32 moments; one chunk per parameter
        (torch.bfloat16, torch.float32, 384, 0),
        # fp32 throughout (no rounding noise): parameters larger than a chunk are stepped in slices
        (torch.float32, torch.float32, 64, 0),
        # the first parameter's moments (192 bytes) stay on the device, the others stream
        (torch.bfloat16, torch.bfloat16, 100, 200),
    ],
)
@pytest.mark.parametrize(("clip", "microbatches"), [(False, 1), (True, 3)])
@pytest.mark.parametrize("device", _DEVICES)
def test_offloaded_step_equals_on_device_step(
    dtype: torch.dtype,
    state_dtype: torch.dtype,
    chunk_bytes: int,
    resident_bytes: int,
    clip: bool,
    microbatches: int,
    device: str,
) -> None:
    on_device, offloaded = _params(dtype, device), _params(dtype, device)
    backend = KernelBackend.REFERENCE if device == "cpu" else KernelBackend.AUTO
    kwargs = {"lr": 0.05, "weight_decay": 0.1, "state_dtype": state_dtype, "backend": backend}
    reference = StochasticAdamW(on_device, **kwargs)
    offload = HostStateOffload(chunk_bytes=chunk_bytes, resident_bytes=resident_bytes)
    streamed = StochasticAdamW(offloaded, offload=offload, **kwargs)
    for optimizer, params in ((reference, on_device), (streamed, offloaded)):
        _run(params, optimizer, steps=4, clip=clip, microbatches=microbatches)
    for index, (ours, theirs) in enumerate(zip(offloaded, on_device, strict=True)):
        assert torch.equal(ours, theirs)
        for name in ("exp_avg", "exp_avg_sq"):
            moment = streamed.state[ours][name]
            if index == 0 and resident_bytes:
                assert moment.device == ours.device
            else:
                assert moment.device.type == "cpu" and moment.is_pinned() == (device == "cuda")
            assert torch.equal(moment.cpu(), reference.state[theirs][name].cpu())
            assert moment.dtype == state_dtype
        assert float(streamed.state[ours]["step"]) == float(reference.state[theirs]["step"]) == 4.0


def test_chunks_hold_at_most_the_chunk_size_and_split_large_parameters() -> None:
    params = [torch.zeros(n) for n in (4, 4, 30, 2)]
    operands = [
        StreamedOperands(param=p, grad=p, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), seed=i)
        for i, p in enumerate(params)
    ]
    chunks = plan_chunks(operands, chunk_bytes=80)  # 10 elements of two fp32 moments
    assert [[piece.exp_avg.numel() for piece in chunk] for chunk in chunks] == [[4, 4], [10], [10], [10], [2]]
    # each slice of the split parameter rounds with its own seed
    assert len({piece.seed for chunk in chunks[1:4] for piece in chunk}) == 3


def test_offloaded_state_round_trips_through_state_dict() -> None:
    source, target = _params(torch.bfloat16), _params(torch.bfloat16)
    offload = HostStateOffload(chunk_bytes=128)
    saved = StochasticAdamW(source, lr=0.05, state_dtype=torch.bfloat16, offload=offload)
    _run(source, saved, steps=2, clip=False, microbatches=1)
    loaded = StochasticAdamW(target, lr=0.05, state_dtype=torch.bfloat16, offload=offload)
    host_buffers = [loaded.state[p]["exp_avg"] for p in target]
    loaded.load_state_dict(saved.state_dict())
    for theirs, ours, buffer in zip(source, target, host_buffers, strict=True):
        assert loaded.state[ours]["exp_avg"] is buffer  # loaded into the host buffers, not moved
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded.state[ours][name], saved.state[theirs][name])


def test_offload_without_enough_host_memory_is_refused_before_allocating() -> None:
    params = [torch.nn.Parameter(torch.zeros(1024, dtype=torch.bfloat16))]
    offload = HostStateOffload(available_host_bytes=lambda: 1000)
    expected = r"needs 0\.00 GiB \(8192 bytes\) .* only 0\.00 GiB \(1000 bytes\) is available"
    with pytest.raises(ValueError, match=expected) as raised:
        StochasticAdamW(params, state_dtype=torch.float32, offload=offload)
    assert "pinned host memory" in str(raised.value)


def test_resident_moments_are_left_out_of_the_host_memory_check() -> None:
    params = [torch.nn.Parameter(torch.zeros(1024, dtype=torch.bfloat16)) for _ in range(2)]
    # 8 KiB of fp32 moments per parameter: the first stays on the device, the host holds the second
    offload = HostStateOffload(resident_bytes=8192, available_host_bytes=lambda: 8192)
    StochasticAdamW(params, state_dtype=torch.float32, offload=offload)
    with pytest.raises(ValueError, match=r"needs 0\.00 GiB \(16384 bytes\)"):
        StochasticAdamW(params, state_dtype=torch.float32, offload=replace(offload, resident_bytes=0))


def test_processes_of_one_host_share_its_free_memory() -> None:
    params = [torch.nn.Parameter(torch.zeros(1024, dtype=torch.bfloat16))]
    # 8 KiB of fp32 moments: 16 KiB free fits one process, not four
    alone = HostStateOffload(available_host_bytes=lambda: 16384)
    StochasticAdamW(params, state_dtype=torch.float32, offload=alone)
    offload = replace(alone, processes_per_host=4)
    expected = r"only 0\.00 GiB \(4096 bytes\) is available \(0\.00 GiB \(16384 bytes\) free, shared by 4 "
    with pytest.raises(ValueError, match=expected):
        StochasticAdamW(params, state_dtype=torch.float32, offload=offload)


@pytest.mark.parametrize("wrong", [{"chunk_bytes": 0}, {"resident_bytes": -1}, {"processes_per_host": 0}])
def test_sizes_out_of_range_are_refused(wrong: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(wrong))}="):
        HostStateOffload(**wrong)
