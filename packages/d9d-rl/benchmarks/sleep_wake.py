"""Trainer sleep/wake on CUDA: memory left on the device, and cycle time against PCIe/NVLink-C2C bandwidth.

Run on a GPU machine:  uv run packages/d9d-rl/benchmarks/sleep_wake.py [--params-gb 8] [--cycles 5]

Builds a plain stack of linear layers with AdamW state (parameters + gradients + two moments:
four tensors per parameter, fp32), then in the same run:
1. measures the host<->device bandwidth with pinned copies of the same total size (one buffer
   per direction, the best of three),
2. runs ``--cycles`` sleep/wake cycles through d9d-loop's ``TensorOffloader`` (the code behind
   ``Trainer.sleep``), and reports the device memory after sleep against the awake footprint
   (goal: under 5%) and the bytes moved per second against the measured bandwidth (goal: >= 70%).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from d9d.loop import TensorOffloader


def _bandwidth(nbytes: int, device: torch.device) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best_d2h = best_h2d = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        best_d2h, best_h2d = min(best_d2h, t1 - t0), min(best_h2d, t2 - t1)
    del host, dev
    torch.cuda.empty_cache()
    return nbytes / best_d2h, nbytes / best_h2d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-gb", type=float, default=4.0, help="parameter bytes (fp32), GiB")
    parser.add_argument("--cycles", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device("cuda", 0)
    width = 8192
    layers = max(1, int(args.params_gb * 2**30 / (width * width * 4)))
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model(torch.randn(8, width, device=device)).sum().backward()
    optimizer.step()  # creates the moments; gradients are kept, as between accumulation steps
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    awake = torch.cuda.memory_allocated(device)
    awake_reserved = torch.cuda.memory_reserved(device)

    tensors: list[torch.Tensor] = [*model.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    moved = sum(t.untyped_storage().nbytes() for t in tensors if t.is_cuda)
    d2h, h2d = _bandwidth(moved, device)

    offloader = TensorOffloader(device)
    reference = [p.detach().clone().cpu() for p in list(model.parameters())[:2]]
    sleeps: list[float] = []
    wakes: list[float] = []
    asleep_reserved = 0
    for _ in range(args.cycles):
        t0 = time.perf_counter()
        offloader.offload(tensors)
        t1 = time.perf_counter()
        asleep_reserved = torch.cuda.memory_reserved(device)
        offloader.restore()
        t2 = time.perf_counter()
        sleeps.append(t1 - t0)
        wakes.append(t2 - t1)
    exact = all(torch.equal(r, p.detach().cpu()) for r, p in zip(reference, model.parameters(), strict=False))
    gib = 2**30
    sleep_s, wake_s = statistics.median(sleeps[1:] or sleeps), statistics.median(wakes[1:] or wakes)
    print(f"device: {torch.cuda.get_device_name(device)}")
    print(f"state moved: {moved / gib:.2f} GiB (params, grads, AdamW moments); bit-exact after wake: {exact}")
    print(f"awake: {awake / gib:.2f} GiB allocated, {awake_reserved / gib:.2f} GiB reserved")
    print(
        f"asleep: {asleep_reserved / gib:.3f} GiB reserved = {100 * asleep_reserved / awake_reserved:.2f}% "
        "of the awake footprint (goal < 5%)"
    )
    print(f"pinned bandwidth: D2H {d2h / gib:.1f} GiB/s, H2D {h2d / gib:.1f} GiB/s")
    sleep_rate, wake_rate = moved / sleep_s, moved / wake_s
    print(
        f"sleep {sleep_s * 1e3:.0f} ms = {sleep_rate / gib:.1f} GiB/s "
        f"= {100 * sleep_rate / d2h:.0f}% of D2H; "
        f"wake {wake_s * 1e3:.0f} ms = {wake_rate / gib:.1f} GiB/s = {100 * wake_rate / h2d:.0f}% of H2D"
    )
    print("(goal >= 70%; the first cycle, which allocates the pinned buffers, is excluded)")


if __name__ == "__main__":
    main()
