"""``qk_norm_rope`` with gradients: the fused kernels against the separate ops under torch.compile.

GPU kernel time (``triton.testing.do_bench``) on one GPU, bf16, 16384 positions, at Gemma-3-1B's
heads (4 query, 1 key, 256 wide, ``(1 + weight)`` norms) and Qwen3-0.6B's (16, 8, 128):

- forward + backward of ``rms_norm`` then ``apply_rope`` on queries and keys compiled by Inductor
  (what a compiled model ran before the fused op), against the fused op eager and compiled, as the
  profiler's sum of GPU work (alone, these ops wait on the host);
- the fused forward over tile rows, and its backward over tile rows and persistent programs per
  multiprocessor, with the bandwidth each reaches (the current launch marked).

Run: python packages/d9d-kernels/benchmarks/bench_qk_norm_rope.py
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from _harness import gpu_kernel_ms, gpu_us, outputs_close

from d9d.kernels import KernelBackend, apply_rope, qk_norm_rope, rms_norm
from d9d.kernels._triton.qk_norm_rope_kernels import qk_norm_rope_backward, qk_norm_rope_kernel

POSITIONS = 16384
SHAPES = {"gemma-3-1b": (4, 1, 256, True), "qwen3-0.6b": (16, 8, 128, False)}
Tensors = tuple[torch.Tensor, ...]


def separate(
    query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, zero_centered: bool, backend: KernelBackend,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    out = []
    for x, weight in ((query, q_weight), (key, k_weight)):
        normed = rms_norm(x, weight, 1e-6, zero_centered_weight=zero_centered, backend=backend)
        out.append(apply_rope(normed, cos, sin, backend=backend))
    return out[0], out[1]


def fused(
    query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, zero_centered: bool, backend: KernelBackend,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return qk_norm_rope(
        query,
        key,
        q_weight,
        k_weight,
        cos,
        sin,
        eps=1e-6,
        zero_centered_weight=zero_centered,
        backend=backend,
    )


def compare(name: str, q_heads: int, k_heads: int, head_dim: int, zero_centered: bool) -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    query = torch.randn(4, POSITIONS // 4, q_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    key = torch.randn(4, POSITIONS // 4, k_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    weights = [torch.randn(head_dim, device=device, dtype=dtype).requires_grad_() for _ in range(2)]
    angles = torch.randn(1, POSITIONS // 4, head_dim, device=device).expand(4, -1, -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grads = (torch.randn_like(query), torch.randn_like(key))
    leaves = [query, key, *weights]
    bytes_one_way = 2 * (query.numel() + key.numel()) * query.element_size()

    def step(
        op: Callable[..., tuple[torch.Tensor, torch.Tensor]], backend: KernelBackend
    ) -> Callable[[], None]:
        def run() -> None:
            for leaf in leaves:
                leaf.grad = None
            torch.autograd.backward(op(query, key, *weights, cos, sin, zero_centered, backend), grads)

        return run

    print(f"--- {name}: q {tuple(query.shape)}, k {k_heads} heads, bf16")
    rows = {
        "separate, compiled": step(torch.compile(separate), KernelBackend.REFERENCE),
        "fused, eager": step(fused, KernelBackend.TRITON),
        "fused, compiled": step(torch.compile(fused), KernelBackend.TRITON),
    }
    for label, run in rows.items():
        run()
        # GPU work only: alone, these small ops wait on the host's launches and autograd
        print(f"{label:20s} forward + backward {gpu_kernel_ms(run, iters=10) * 1000:7.1f} us of kernels")

    with torch.no_grad():
        reference = qk_norm_rope_kernel(query, key, *weights, cos, sin, 1e-6, zero_centered, False)
        for tile in (1, 2, 4, 8, 16, 32):
            us = gpu_us(
                lambda tile=tile: qk_norm_rope_kernel(
                    query, key, *weights, cos, sin, 1e-6, zero_centered, False, rows_per_tile=tile
                )
            )
            got = qk_norm_rope_kernel(
                query, key, *weights, cos, sin, 1e-6, zero_centered, False, rows_per_tile=tile
            )
            same = all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
            print(f"forward rows {tile:2d}: {us:6.1f} us {bytes_one_way / us / 1e6:5.2f} TB/s same={same}")
        operands = (*grads, query, key, *weights, cos, sin, 1e-6, zero_centered, False)
        expected = qk_norm_rope_backward(*operands)
        timed: list[tuple[float, int, int, bool]] = []
        for tile, per_sm in itertools.product((1, 2, 4, 8, 16, 32), (2, 4, 8, 16)):
            us = gpu_us(
                lambda t=tile, p=per_sm: qk_norm_rope_backward(*operands, rows_per_tile=t, programs_per_sm=p)
            )
            got = qk_norm_rope_backward(*operands, rows_per_tile=tile, programs_per_sm=per_sm)
            timed.append((us, tile, per_sm, outputs_close(got, expected)))
        now = gpu_us(lambda: qk_norm_rope_backward(*operands))
        print(f"backward now: {now:6.1f} us {1.5 * bytes_one_way / now / 1e6:5.2f} TB/s")
        for us, tile, per_sm, near in sorted(timed)[:8]:
            print(
                f"  rows {tile:2d} per SM {per_sm:2d}: {us:6.1f} us "
                f"{1.5 * bytes_one_way / us / 1e6:5.2f} TB/s same={near}"
            )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_qk_norm_rope needs a CUDA GPU")
    print(torch.cuda.get_device_name())
    for name, shape in SHAPES.items():
        compare(name, *shape)


if __name__ == "__main__":
    main()
