"""Memory saved by ``checkpoint_modules``: bytes autograd keeps from forward, and the CUDA peak.

Run:  uv run packages/d9d-parallel/benchmarks/activation_checkpointing_memory.py [--device cuda]

A stack of MLP blocks (Linear-GELU-Linear with a residual) runs forward and backward without
checkpointing, with full and with selective checkpointing of every block. On the CPU the figure
is the bytes of tensors autograd saves during forward (counted with ``saved_tensors_hooks``:
exact, independent of the allocator); on CUDA also the peak allocated memory of the step. The
outputs that selective checkpointing keeps bypass ``saved_tensors_hooks`` in torch 2.15, so its
CPU figure counts only the block inputs: compare selective by the CUDA peak.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from d9d.parallel import FullCheckpointing, SelectiveCheckpointing, checkpoint_modules


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def measure(
    policy: str, *, layers: int, hidden: int, tokens: int, device: torch.device
) -> tuple[float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(hidden) for _ in range(layers))).to(device)
    match policy:
        case "none":
            pass
        case "full":
            checkpoint_modules(model, lambda name, m: isinstance(m, Block), FullCheckpointing())
        case _:
            checkpoint_modules(model, lambda name, m: isinstance(m, Block), SelectiveCheckpointing())
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    peak = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else 0
    return saved[0] / 2**20, peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{args.layers} blocks, hidden {args.hidden}, {args.tokens} tokens, {device}")
    print(f"{'policy':<10} {'saved by forward (MiB)':>24} {'CUDA peak above params (MiB)':>30}")
    for policy in ("none", "full", "selective"):
        saved, peak = measure(
            policy, layers=args.layers, hidden=args.hidden, tokens=args.tokens, device=device
        )
        print(f"{policy:<10} {saved:>24.1f} {peak:>30.1f}")


if __name__ == "__main__":
    main()
