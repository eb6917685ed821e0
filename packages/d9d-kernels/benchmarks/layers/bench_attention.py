"""Attention forward + backward TFLOP/s per backend on one GPU (Qwen3-8B-like heads, bf16).

Run from the repository root on a CUDA machine:
    PYTHONPATH=packages/d9d-kernels/src python3 packages/d9d-kernels/benchmarks/layers/bench_attention.py

FLOPs counted as FlashAttention does: forward 4 * batch * seq^2 * q_heads * head_dim (halved when
causal), backward 2.5x forward; packed rows are counted as if dense (the usual convention), so
packed numbers are "effective" TFLOP/s. The last rows run packed documents on FlexAttention's own
kernel with a document block mask (``torch_flash=False``), the path of float32 inputs and of head
dims that PyTorch's FlashAttention kernels do not take.

A second table times sliding-window attention at Gemma-3-1B's heads (4 query heads and 1
key/value head of 256, window 512, 4 x 4096 tokens): SDPA given the window as a dense mask
against the ``flex_attention`` backend (PyTorch's FlashAttention kernels where the torch version
has them) and FlexAttention's block-sparse kernel alone (``torch_flash=False``): forward
and the input gradients, median of 5 alternating rounds of 20 calls.

A third table times attention with sinks at GPT-OSS-20B's heads (64 query and 8 key/value heads of
64, 4 x 4096 tokens), the 128-token window and full causal, on unpacked rows and on rows of 4
packed documents: SDPA (a dense float mask with the sink column) against the ``flex_attention``
backend (FlexAttention, with a block mask of the documents for packed rows), forward and the
query/key/value and sink gradients, median of 5 alternating rounds of 10 calls.
"""

import argparse
import json
from collections.abc import Callable

import torch

from d9d.kernels.layers import (
    AttentionBackend,
    AttentionBackendUnavailableError,
    FlexAttentionBackend,
    SdpaAttentionBackend,
    SinkAttentionBackend,
    build_attention_backend,
)

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKENS_PER_STEP = 16384
BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_4")
WINDOW_BACKENDS = ("sdpa", "flex_attention", "flash_attention_2", "flash_attention_4")
FLEX_KERNEL_ONLY = "flex_attention (torch_flash=False)"


def time_ms(step: Callable[[], object], *, warmup: int = 3, iters: int = 10) -> float:
    """Mean milliseconds of ``step`` (CUDA events) after ``warmup`` untimed calls."""
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


def _documents(batch: int, seq: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` equal documents per row."""
    return (torch.arange(seq, device=device) * count // seq).expand(batch, seq).contiguous()


def _measure(backend: AttentionBackend, batch: int, seq: int, packed: bool) -> float:
    device = torch.device("cuda")
    q = torch.randn(batch, seq, Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, seq, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, seq, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(batch, seq, Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    documents = _documents(batch, seq, 4, device) if packed else None

    def step() -> None:
        out = backend.attend(q, k, v, causal=True, softmax_scale=HEAD_DIM**-0.5, document_ids=documents)
        out.backward(upstream)

    return time_ms(step)


def _window_step(backend: AttentionBackend, window: int | None) -> Callable[[], object]:
    """Gemma-3-1B's heads, 4 x 4096 tokens: one forward and the query/key/value gradients."""
    device = torch.device("cuda")
    shape_q, shape_kv = (4, 4096, 4, 256), (4, 4096, 1, 256)
    q = torch.randn(shape_q, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(shape_q, device=device, dtype=torch.bfloat16)

    def step() -> object:
        out = backend.attend(q, k, v, causal=True, softmax_scale=256**-0.5, sliding_window=window)
        return torch.autograd.grad(out, (q, k, v), upstream)

    return step


def _window_table(results: list[dict[str, object]]) -> None:
    """Each (backend, window) timed once per round, the rounds alternating: median of 5 rounds of 20 calls."""
    steps: dict[tuple[str, int | None], Callable[[], object]] = {}
    for name in (*WINDOW_BACKENDS, FLEX_KERNEL_ONLY):
        try:
            backend = (
                FlexAttentionBackend(torch_flash=False)
                if name == FLEX_KERNEL_ONLY
                else build_attention_backend(name)
            )
        except AttentionBackendUnavailableError:
            continue
        for window in (512, None):
            steps[(name, window)] = _window_step(backend, window)
    times: dict[tuple[str, int | None], list[float]] = {key: [] for key in steps}
    for _ in range(5):
        for key, step in steps.items():
            times[key].append(time_ms(step, warmup=5, iters=20))
    print("\n| backend | window | fwd+bwd ms, median (min-max) of 5 alternating rounds | vs sdpa |")
    print("|---|---|---|---|")
    baseline = sorted(times[("sdpa", 512)])[2]
    for (name, window), measured in times.items():
        ordered = sorted(measured)
        median = ordered[len(ordered) // 2]
        ratio = f"{baseline / median:.2f}x" if window == 512 else "-"
        label = "causal" if window is None else str(window)
        print(f"| {name} | {label} | {median:.3f} ({ordered[0]:.3f}-{ordered[-1]:.3f}) | {ratio} |")
        results.append({"backend": name, "window": window, "ms": median, "ms_all": measured})


def _sinks_step(backend: SinkAttentionBackend, window: int | None, packed: bool) -> Callable[[], object]:
    """GPT-OSS-20B's heads, 4 x 4096 tokens: one forward with sinks and the input and sink gradients."""
    device = torch.device("cuda")
    shape_q, shape_kv = (4, 4096, 64, 64), (4, 4096, 8, 64)
    q = torch.randn(shape_q, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.randn(64, device=device, requires_grad=True)
    upstream = torch.randn(shape_q, device=device, dtype=torch.bfloat16)
    documents = _documents(4, 4096, 4, device) if packed else None

    def step() -> object:
        out = backend.attend_with_sinks(
            q,
            k,
            v,
            sinks=sinks,
            causal=True,
            softmax_scale=64**-0.5,
            sliding_window=window,
            document_ids=documents,
        )
        return torch.autograd.grad(out, (q, k, v, sinks), upstream)

    return step


def _sinks_table(results: list[dict[str, object]]) -> None:
    """Each (backend, window, packed) timed once per round, the rounds alternating: median of 5 rounds."""
    backends: dict[str, SinkAttentionBackend] = {
        "sdpa": SdpaAttentionBackend(),
        "flex_attention": FlexAttentionBackend(),
    }
    steps = {
        (name, window, packed): _sinks_step(backend, window, packed)
        for name, backend in backends.items()
        for window in (128, None)
        for packed in (False, True)
    }
    times: dict[tuple[str, int | None, bool], list[float]] = {key: [] for key in steps}
    for _ in range(5):
        for key, step in steps.items():
            times[key].append(time_ms(step, warmup=3, iters=10))
    print("\n| sinks: backend | window | packed (4 docs/row) | fwd+bwd ms, median (min-max) of 5 | vs sdpa |")
    print("|---|---|---|---|---|")
    for (name, window, packed), measured in times.items():
        ordered = sorted(measured)
        median = ordered[len(ordered) // 2]
        baseline = sorted(times[("sdpa", window, packed)])[2]
        label = "causal" if window is None else str(window)
        spread = f"{median:.3f} ({ordered[0]:.3f}-{ordered[-1]:.3f})"
        print(f"| {name} | {label} | {packed} | {spread} | {baseline / median:.2f}x |")
        results.append(
            {
                "sinks": True,
                "backend": name,
                "window": window,
                "packed": packed,
                "ms": median,
                "ms_all": measured,
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--eager-max-seq", type=int, default=8192)
    parser.add_argument("--window-only", action="store_true", help="the sliding-window table only")
    parser.add_argument("--sinks-only", action="store_true", help="the attention-sinks table only")
    args = parser.parse_args()
    results: list[dict[str, object]] = []
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if not (args.window_only or args.sinks_only):
        print("| backend | seq | batch | packed (4 docs/row) | fwd+bwd ms | TFLOP/s |")
        print("|---|---|---|---|---|---|")
    if args.sinks_only:
        _sinks_table(results)
    for name in () if args.window_only or args.sinks_only else (*BACKENDS, FLEX_KERNEL_ONLY):
        try:
            backend = (
                FlexAttentionBackend(torch_flash=False)
                if name == FLEX_KERNEL_ONLY
                else build_attention_backend(name)
            )
        except AttentionBackendUnavailableError as error:
            print(f"| {name} | - | - | - | not installed ({str(error).split(':')[0]}) | - |")
            results.append({"backend": name, "available": False})
            continue
        for seq in (4096, 8192):
            if name == "eager" and seq > args.eager_max_seq:
                continue
            batch = max(1, TOKENS_PER_STEP // seq)
            if name == "eager":
                batch = 1  # the fp32 score matrix of a bigger batch does not pay off for a reference
            # without documents the kernel-only row would be SDPA's again: packed rows only
            for packed in (True,) if name == FLEX_KERNEL_ONLY else (False, True):
                torch.cuda.empty_cache()
                ms = _measure(backend, batch, seq, packed)
                forward_flops = 4 * batch * seq * seq * Q_HEADS * HEAD_DIM / 2
                tflops = 3.5 * forward_flops / (ms * 1e-3) / 1e12
                print(f"| {name} | {seq} | {batch} | {packed} | {ms:.2f} | {tflops:.1f} |")
                results.append(
                    {
                        "backend": name,
                        "seq": seq,
                        "batch": batch,
                        "packed": packed,
                        "ms": ms,
                        "tflops": tflops,
                    }
                )
    if not args.sinks_only:
        _window_table(results)
        _sinks_table(results)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
