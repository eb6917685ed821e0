"""Qwen3 training throughput: the full d9d job against transformers and torchtitan, same GPU, same run.

Each implementation runs in its own process (clean memory statistics and compile caches), on
random tokens, and reports tokens/s, MFU and peak memory. MFU counts
``6 x (non-embedding active parameters + LM head) x tokens`` plus causal attention
(``6 x seq x heads x head_dim`` per token and layer), over the bf16 matmul peak measured in the
same run.

    python train_throughput.py --model dense                 # every implementation, one GPU
    torchrun --nproc-per-node 2 train_throughput.py --impl d9d --model dense   # d9d on 2 GPUs
    python train_throughput.py --quick --device cpu          # a tiny smoke run on a CPU

Implementations: ``hf`` (transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM, plain loop, bf16),
``hf_compile`` (the same under ``torch.compile``), ``titan`` (torchtitan 0.2.2's Qwen3 model and
loss, each block compiled, as its trainer does), ``d9d`` (config -> TrainingConfigurator ->
Trainer with d9d-hf's Qwen3 provider, FSDP mixed precision bf16 with float32 master weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

IMPLEMENTATIONS = ("hf", "hf_compile", "titan", "d9d", "d9d_compile")

DENSE_0_6B: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
}
MOE_30B_A3B_6_LAYERS: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
}
QUICK: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
}


def model_shape(name: str, quick: bool) -> dict[str, Any]:
    shape = dict(DENSE_0_6B if name == "dense" else MOE_30B_A3B_6_LAYERS)
    if quick:
        shape.update({k: v for k, v in QUICK.items() if k in shape})
    return shape


def flops_per_token(shape: dict[str, Any], seq: int) -> float:
    """Training FLOPs per token: 6 x active matmul parameters (LM head included) + causal attention."""
    h, heads, kv, dh = (
        shape["hidden_size"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
    )
    attention_params = h * heads * dh * 2 + h * kv * dh * 2
    if shape["model_type"] == "qwen3_moe":
        mlp_params = (
            h * shape["num_experts"] + shape["num_experts_per_tok"] * 3 * h * shape["moe_intermediate_size"]
        )
    else:
        mlp_params = 3 * h * shape["intermediate_size"]
    layers = shape["num_hidden_layers"]
    dense = 6 * (layers * (attention_params + mlp_params) + h * shape["vocab_size"])
    attention = 6 * seq * heads * dh * layers  # causal: half of the 12 x s x H x dh of full attention
    return float(dense + attention)


def measure_peak_tflops(device: torch.device) -> float:
    """bf16 matmul rate of this GPU (8192^3, mean of 10 after 3 warm-ups)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - start) / 1e12


@dataclasses.dataclass(kw_only=True)
class Result:
    implementation: str
    world_size: int
    tokens_per_s: float
    peak_memory_gib: float
    final_loss: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_plain_loop(step: Any, args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    loss = 0.0
    for _ in range(args.warmup):
        loss = step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    _sync(device)
    elapsed = time.perf_counter() - start
    return args.batch * args.seq * args.steps / elapsed, float(loss)


def _tokens(args: argparse.Namespace, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)


def run_hf(args: argparse.Namespace, shape: dict[str, Any], device: torch.device, compiled: bool) -> float:
    import transformers

    config_class = (
        transformers.Qwen3MoeConfig if shape["model_type"] == "qwen3_moe" else transformers.Qwen3Config
    )
    model_class = (
        transformers.Qwen3MoeForCausalLM
        if shape["model_type"] == "qwen3_moe"
        else transformers.Qwen3ForCausalLM
    )
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    config = config_class(**fields, attn_implementation="sdpa")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model: Any = model_class(config).to(device=device, dtype=dtype)
    model.train()
    if compiled:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = _tokens(args, shape["vocab_size"], device)

    def step() -> torch.Tensor:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    tokens_per_s, loss = _timed_plain_loop(step, args, device)
    return _report(args, "hf_compile" if compiled else "hf", tokens_per_s, loss, device)


def run_titan(args: argparse.Namespace, shape: dict[str, Any], device: torch.device) -> float:
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    base = qwen3_args["0.6B" if shape["model_type"] == "qwen3" else "30B-A3B"]
    model_args = dataclasses.replace(
        base,
        n_layers=shape["num_hidden_layers"],
        dim=shape["hidden_size"],
        n_heads=shape["num_attention_heads"],
        n_kv_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        hidden_dim=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
        max_seq_len=args.seq,
    )
    with torch.device("meta"):
        model = Qwen3Model(model_args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to(dtype=dtype)
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, fullgraph=True))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = _tokens(args, shape["vocab_size"], device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        loss = cross_entropy_loss(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    tokens_per_s, loss = _timed_plain_loop(step, args, device)
    return _report(args, "titan", tokens_per_s, loss, device)


class _RandomTokens:
    """A map-style dataset of random rows (a new row per index, seeded)."""

    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        self._rows, self._seq, self._vocab = rows, seq, vocab

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index: int) -> Any:
        from d9d.hf import TokenSample

        generator = torch.Generator().manual_seed(index)
        return TokenSample(input_ids=torch.randint(0, self._vocab, (self._seq,), generator=generator))


def run_d9d(args: argparse.Namespace, shape: dict[str, Any], device: torch.device, compiled: bool) -> float:
    from d9d.hf import ScratchModelConfig, TokenBatch, causal_lm_task
    from d9d.hf.qwen3 import Qwen3ModelProvider
    from d9d.loop import (
        AutoDataProvider,
        AutoLRSchedulerProvider,
        AutoOptimizerProvider,
        ProjectConfig,
        StepFinished,
        TrainingConfigurator,
    )

    world = int(os.environ.get("WORLD_SIZE", "1"))
    profiled = 2 if args.profile else 0
    total_steps = args.warmup + args.steps + profiled
    config = ProjectConfig.model_validate(
        {
            "mesh": {"data_parallel_shard": world},
            "trainer": {
                "max_steps": total_steps,
                "global_batch_size": args.batch * world,
                "microbatch_size": args.batch,
                "logging": {"progress_bar": False},
                "device": device.type,
                "initialization": {"layout_invariant": False},
                "gradient_clipping": {"max_norm": 1.0},
            },
            "optimizer": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.0},
        }
    )
    model = ScratchModelConfig.model_validate(
        {"config": shape, "param_dtype": "bfloat16" if device.type == "cuda" else None, "compile": compiled}
    )
    times: list[float] = []
    losses: list[float] = []
    peaks: list[float] = []

    profiler: Any = None

    def on_step(event: StepFinished) -> None:
        nonlocal profiler
        times.append(time.perf_counter())
        losses.append(event.metrics["loss"])
        # the loop reads and resets the allocator's peak every step: take its per-step figure
        peaks.append(event.metrics.get("memory/peak_gib", float("nan")))
        if not args.profile or int(os.environ.get("RANK", "0")) != 0:
            return
        if event.step == args.warmup + args.steps - 1:  # two extra steps after the timed ones
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        elif profiler is not None and event.step == args.warmup + args.steps + 1:
            _sync(device)
            profiler.__exit__(None, None, None)
            sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(profiler.key_averages().table(sort_by=sort, row_limit=25), flush=True)
            profiler = None

    with TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=Qwen3ModelProvider(model),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _ctx: _RandomTokens(
                total_steps * args.batch * world, args.seq, shape["vocab_size"]
            ),
            collator=TokenBatch.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure() as trainer:
        trainer.events.subscribe(StepFinished, on_step)
        trainer.train()
        _sync(device)
        elapsed = times[args.warmup + args.steps - 1] - times[args.warmup - 1]
        tokens_per_s = args.batch * world * args.seq * args.steps / elapsed
        name = "d9d_compile" if compiled else "d9d"
        return _report(
            args,
            name,
            tokens_per_s,
            losses[-1],
            device,
            world=world,
            peak_gib=max(peaks, default=float("nan")),
        )


def _report(
    args: argparse.Namespace,
    name: str,
    tokens_per_s: float,
    loss: float,
    device: torch.device,
    *,
    world: int = 1,
    peak_gib: float | None = None,
) -> float:
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    if peak_gib is not None and not math.isnan(peak_gib):  # the loop's per-step peaks
        peak = peak_gib
    result = Result(
        implementation=name,
        world_size=world,
        tokens_per_s=tokens_per_s,
        peak_memory_gib=peak,
        final_loss=loss,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        line = json.dumps(dataclasses.asdict(result))
        print(f"RESULT {line}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")
    return tokens_per_s


def run_one(args: argparse.Namespace) -> None:
    device = torch.device(
        args.device if args.device != "cuda" else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    shape = model_shape(args.model, args.quick)
    match args.impl:
        case "hf":
            run_hf(args, shape, device, compiled=False)
        case "hf_compile":
            run_hf(args, shape, device, compiled=True)
        case "titan":
            run_titan(args, shape, device)
        case "d9d":
            run_d9d(args, shape, device, compiled=False)
        case "d9d_compile":
            run_d9d(args, shape, device, compiled=True)
        case _:
            raise ValueError(f"unknown implementation {args.impl!r}")


def run_all(args: argparse.Namespace) -> None:
    """Runs every implementation in its own process and prints the table with ratios."""
    device = torch.device(args.device)
    peak = measure_peak_tflops(device)
    shape = model_shape(args.model, args.quick)
    flops = flops_per_token(shape, args.seq)
    results: dict[str, dict[str, Any]] = {}
    out = Path(args.json or f"/tmp/d9d_throughput_{os.getpid()}.jsonl")
    out.unlink(missing_ok=True)
    for name in args.only or IMPLEMENTATIONS:
        command = [sys.executable, __file__, "--impl", name, "--json", str(out)]
        command += [
            f"--{k}={v}"
            for k, v in vars(args).items()
            if k in ("model", "device", "seq", "batch", "steps", "warmup")
        ]
        command += ["--quick"] if args.quick else []
        command += ["--profile"] if args.profile and name == "d9d" else []
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
        if args.profile and name == "d9d":
            print(done.stdout[-12000:], flush=True)
        if done.returncode != 0:
            print(
                f"{name}: FAILED after {time.perf_counter() - started:.0f} s\n{done.stderr[-2500:]}",
                flush=True,
            )
    for line in out.read_text().splitlines() if out.exists() else []:
        record = json.loads(line)
        results[record["implementation"]] = record
    print(
        f"\nQwen3 {args.model} ({shape['num_hidden_layers']} layers), seq {args.seq}, batch {args.batch}, "
        f"{args.device}; bf16 matmul peak measured: {peak:.0f} TFLOP/s; {flops / 1e9:.2f} GFLOP/token"
    )
    print("| implementation | tok/s | MFU | peak memory (GiB) | tok/s vs torchtitan | memory vs torchtitan |")
    print("|---|---|---|---|---|---|")
    titan = results.get("titan")
    for name, record in results.items():
        mfu = record["tokens_per_s"] * flops / (peak * 1e12)
        speed = record["tokens_per_s"] / titan["tokens_per_s"] if titan else float("nan")
        memory = record["peak_memory_gib"] / titan["peak_memory_gib"] if titan else float("nan")
        print(
            f"| {name} | {record['tokens_per_s'] / 1e3:.1f}k | {mfu:.1%} | {record['peak_memory_gib']:.1f} "
            f"| {speed:.2f}x | {memory:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--impl", choices=[*IMPLEMENTATIONS, "all"], default="all")
    parser.add_argument("--only", nargs="*", choices=IMPLEMENTATIONS, help="with --impl all: these only")
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny model, for a smoke run")
    parser.add_argument("--json", help="append each result as a JSON line here")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--profile", action="store_true", help="d9d: print the top kernels of two steps")
    args = parser.parse_args()
    if args.impl == "all":
        run_all(args)
    else:
        run_one(args)


if __name__ == "__main__":
    main()
