"""FlashAttention 4 against SDPA, attention alone, at Qwen3-0.6B heads (16 q / 8 kv, head_dim 128, bf16).

Run from the repository root on a Hopper or Blackwell machine with the extra installed:
    PYTHONPATH=packages/d9d-kernels/src \
        python3 packages/d9d-kernels/benchmarks/layers/bench_flash_attention.py

Causal self-attention on about 32k tokens per step (batch * seq) at seq 4096 to 32768, forward and
forward + backward, through d9d's ``sdpa`` and ``flash_attention_4`` backends; then packed rows of
seq 4096 with 4 equal documents each (SDPA masks, FlashAttention 4 goes varlen). FLOPs are counted
as FlashAttention does: forward 4 * seq^2 * q_heads * head_dim / 2 per causal sequence (per
document when packed: the work actually needed), backward 2.5x forward. Without CUDA or without
``flash_attn.cute`` the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from d9d.kernels.layers import AttentionBackend, AttentionBackendUnavailableError, build_attention_backend

Q_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
TOKENS_PER_STEP = 32768
SEQS = (4096, 8192, 16384, 32768)
PACKED_SEQ, DOCUMENTS_PER_ROW = 4096, 4
BACKWARD_FLOPS_FACTOR = 2.5


@dataclass(kw_only=True)
class Row:
    """One shape and pass, both backends."""

    seq: int
    batch: int
    documents_per_row: int
    passes: str
    sdpa_ms: float | None
    fa4_ms: float | None
    tflop: float


def time_ms(step: Callable[[], object], *, warmup: int, iters: int) -> float:
    """Mean milliseconds of ``step`` (CUDA events) after ``warmup`` untimed calls (FA4 compiles in them)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def causal_forward_tflop(batch: int, seq: int, documents_per_row: int) -> float:
    """Forward TFLOP of causal attention over ``batch`` rows of equal documents."""
    doc = seq // documents_per_row
    return 4 * batch * documents_per_row * doc * doc * Q_HEADS * HEAD_DIM / 2 / 1e12


def _step(
    backend: AttentionBackend, batch: int, seq: int, documents_per_row: int, *, backward: bool
) -> Callable[[], None]:
    device = torch.device("cuda")

    def sample(heads: int) -> torch.Tensor:
        shape = (batch, seq, heads, HEAD_DIM)
        return torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)

    q, k, v = sample(Q_HEADS), sample(KV_HEADS), sample(KV_HEADS)
    upstream = torch.randn_like(q, requires_grad=False)
    documents = None
    if documents_per_row > 1:
        positions = torch.arange(seq, device=device) * documents_per_row // seq
        documents = positions.expand(batch, seq).contiguous()

    def step() -> None:
        out = backend.attend(q, k, v, causal=True, softmax_scale=HEAD_DIM**-0.5, document_ids=documents)
        if backward:
            out.backward(upstream)

    return step


def _measure(
    backend: AttentionBackend, batch: int, seq: int, documents_per_row: int, *, backward: bool, iters: int
) -> float | None:
    try:
        return time_ms(
            _step(backend, batch, seq, documents_per_row, backward=backward), warmup=3, iters=iters
        )
    except Exception as error:  # an OOM or a kernel failure must not hide the other rows
        print(f"  {type(backend).__name__} seq={seq} failed: {type(error).__name__}: {error}"[:300])
        return None
    finally:
        torch.cuda.empty_cache()


def _cells(ms: float | None, tflop: float) -> str:
    return "n/a | n/a" if ms is None else f"{ms:.2f} | {tflop / (ms * 1e-3):.0f}"


def run(iters: int) -> list[Row]:
    sdpa = build_attention_backend("sdpa")
    fa4 = build_attention_backend("flash_attention_4")
    shapes = [(TOKENS_PER_STEP // seq, seq, 1) for seq in SEQS]
    shapes.append((TOKENS_PER_STEP // PACKED_SEQ, PACKED_SEQ, DOCUMENTS_PER_ROW))
    print(
        "| seq | batch | docs/row | passes | SDPA ms | SDPA TFLOP/s | FA4 ms | FA4 TFLOP/s | FA4/SDPA speed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows: list[Row] = []
    for batch, seq, documents_per_row in shapes:
        for backward in (False, True):
            forward = causal_forward_tflop(batch, seq, documents_per_row)
            tflop = forward * (1 + BACKWARD_FLOPS_FACTOR) if backward else forward
            sdpa_ms = _measure(sdpa, batch, seq, documents_per_row, backward=backward, iters=iters)
            fa4_ms = _measure(fa4, batch, seq, documents_per_row, backward=backward, iters=iters)
            speed = f"{sdpa_ms / fa4_ms:.2f}x" if sdpa_ms is not None and fa4_ms is not None else "n/a"
            passes = "fwd+bwd" if backward else "fwd"
            print(
                f"| {seq} | {batch} | {documents_per_row} | {passes} | {_cells(sdpa_ms, tflop)} | "
                f"{_cells(fa4_ms, tflop)} | {speed} |"
            )
            row = Row(seq=seq, batch=batch, documents_per_row=documents_per_row, passes=passes,
                      sdpa_ms=sdpa_ms, fa4_ms=fa4_ms, tflop=tflop)  # fmt: skip
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_flash_attention: no CUDA device here; nothing to measure.")
        return
    try:
        build_attention_backend("flash_attention_4")
    except AttentionBackendUnavailableError as error:
        print(f"bench_flash_attention: flash_attn.cute is not importable, skipping: {error}")
        return
    try:
        fa4_version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        fa4_version = "(version unknown)"
    print(
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, flash-attn-4 {fa4_version}; "
        f"q_heads={Q_HEADS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} bf16 causal"
    )
    rows = run(args.iters)
    if args.out:
        with open(args.out, "w") as file:
            json.dump([asdict(row) for row in rows], file, indent=1)


if __name__ == "__main__":
    main()
