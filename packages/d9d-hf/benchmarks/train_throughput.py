"""Decoder training throughput: the full d9d job against transformers and torchtitan, same GPU, same run.

Each implementation runs in its own process (clean memory statistics and compile caches), on
random tokens, and reports tokens/s, MFU and peak memory. MFU counts
``6 x (non-embedding active parameters + LM head) x tokens`` plus causal attention
(``6 x keys x heads x (qk + v head widths)`` per token and layer, ``keys`` the mean keys attended
within the layer's window: ``_shapes.py``), over the bf16 matmul peak measured in the same run.

    python train_throughput.py --model dense                 # every implementation, one GPU
    python train_throughput.py --model llama1b               # Llama-3.2-1B shape, against llama3
    python train_throughput.py --quick --device cpu          # a tiny smoke run on a CPU
    python train_throughput.py --model dense8b --float8 tensorwise   # d9d bf16 and FP8 vs torchtitan FP8
    python train_throughput.py --model gemma3_1b --only hf hf_compile d9d_compile --d9d-state bfloat16
    python train_throughput.py --model deepseek16b --only titan hf_compile d9d_compile --d9d-state bfloat16

d9d on several GPUs (``--batch`` is samples per data-parallel replica and step, so the global
batch is ``batch x data_parallel_shard``; the ranks that ``--pp`` and ``--cp`` leave over shard data):

    python train_throughput.py --impl d9d --json ref.jsonl                       # the 1-GPU reference
    torchrun --nproc-per-node 2 train_throughput.py --impl d9d --reference-json ref.jsonl  # dp_shard 2
    python train_throughput.py --impl d9d --microbatches 4 --busy --json ref.jsonl   # PP's reference
    torchrun --nproc-per-node 2 train_throughput.py --impl d9d --pp 2 --schedule zbv \
        --microbatches 4 --busy --reference-json ref.jsonl             # PP=2, ZBV (or 1f1b, ...)
    python train_throughput.py --impl d9d --seq 32768 --batch 1 --json ref.jsonl   # CP's reference
    torchrun --nproc-per-node 2 train_throughput.py --impl d9d --cp 2 --seq 32768 --batch 1 \
        --reference-json ref.jsonl                                                # CP=2

``--microbatches M`` splits each replica's batch into M microbatches: the pipeline's microbatches
under ``--pp``, gradient accumulation without it. A reference is the last one-process record in
``--reference-json`` of the same implementation, ``--seq``, ``--batch`` and microbatch size; against it
the run prints its speed-up and per-GPU efficiency, and under ``--pp`` the pipeline bubble: the
simulator's prediction for the schedule, the stage imbalance of the layer split, and the measured
bubble (``1 - per-GPU tok/s / one-GPU tok/s``, with ``--busy`` also each rank's GPU idle time).
The d9d rows' steps and their split (forward-backward, optimizer) are timed on the GPU's stream
with CUDA events at each step's start and its optimizer step (the loop's own phases are host
clocks), on a CPU with the host clock at the same points. One untimed step always follows the
timed ones, so that the last timed step ends at a step start, not after the loop's teardown; the
record's ``phases_ms`` lists each timed step's two phases.

Implementations: ``hf`` (transformers' ``*ForCausalLM`` of the shape's family: Qwen3, Qwen3-MoE,
Llama, Gemma 3, Mistral, DeepSeek-V3, GPT-OSS; plain loop, bf16), ``hf_compile`` (the same under
``torch.compile``), ``titan`` (torchtitan 0.2.2's Qwen3, llama3, DeepSeek-V3 or GPT-OSS model and
loss, built in ``_titan_models.py``, its blocks compiled and the gradients clipped to norm 1.0
each step, as its trainer does by default; bf16 parameters and AdamW state; a "not run" row
without torchtitan, none for a family it does not ship), ``titan_amp`` (the same
with float32 parameters and AdamW state under bf16 autocast: how torchtitan's trainer runs on one
device without FSDP, and the same precision as d9d's float32 master weights), ``d9d`` (config ->
TrainingConfigurator -> Trainer with d9d-hf's provider, FSDP mixed precision bf16 with float32
master weights). torchtitan's llama3 model has no tied embedding: its Llama row unties the head
(the same FLOPs; 0.26 B more parameters to hold) while d9d and transformers tie it as the
checkpoint does.

FP8 (``--float8 tensorwise|rowwise``, torchao; H100/H200): the d9d, d9d_compile, titan and
titan_amp rows train their linear layers in FP8 and are named ``<row>_fp8``; the first d9d row
of ``--only`` also runs in bf16 as the baseline (``--no-bf16-baseline``: not), and the ratios
are taken against the FP8 torchtitan rows. d9d sets its model config's ``float8`` section (the LM head and
the routers stay bf16, layers below 128 features too). torchtitan gets its own float8 converter
(``torchtitan.components.quantization.float8.Float8LinearConverter``, built from a default
``JobConfig`` with ``quantize.linear.float8.recipe_name`` and ``filter_fqns=["output",
"router.gate"]``: the same layers as d9d), applied before its blocks are compiled, as its trainer
does. On the MoE shape ``--float8`` also runs the experts' grouped GEMMs in FP8 rowwise (d9d:
``float8.experts``; torchtitan: its ``Float8GroupedMMConverter`` on ``experts``);
``--no-float8-experts`` keeps them in bf16. The MFU column stays against the bf16 peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import torch
from _random_tokens import RandomTokens
from _shapes import SHAPE_HELP, SHAPES, flops_of_layers_and_head, flops_per_token, model_shape
from _throughput_table import GOALS, goal_lines, table_lines
from _titan_models import (
    TITAN_FAMILIES,
    PeerNotInstalledError,
    compile_titan_blocks,
    require_torchtitan,
    titan_logits,
    titan_model,
)

IMPLEMENTATIONS = ("hf", "hf_compile", "titan", "titan_amp", "d9d", "d9d_compile")
FLOAT8_IMPLEMENTATIONS = ("titan", "titan_amp", "d9d", "d9d_compile")
"""The rows ``--float8`` trains in FP8."""
FLOAT8_SUFFIX = "_fp8"


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


def _print_profile(profiler: Any, device: torch.device) -> None:
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(profiler.key_averages().table(sort_by=sort, row_limit=25), flush=True)


def _timed_plain_loop(step: Any, args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    """tok/s over ``args.steps`` steps after ``args.warmup``; with ``--profile``, two more profiled."""
    loss = 0.0
    for _ in range(args.warmup):
        loss = step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    _sync(device)
    elapsed = time.perf_counter() - start
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(2):
                step()
            _sync(device)
        _print_profile(profiler, device)
    return args.batch * args.seq * args.steps / elapsed, float(loss)


def _tokens(args: argparse.Namespace, vocab: int, device: torch.device, extra: int = 0) -> torch.Tensor:
    """``(batch, seq + extra)`` random token ids, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (args.batch, args.seq + extra), generator=generator).to(device)


def hf_attention(model_type: str, device: torch.device) -> str:
    """transformers' attention for the family: SDPA; for GPT-OSS's sinks FlexAttention (eager on a CPU)."""
    if model_type != "gpt_oss":
        return "sdpa"
    return "flex_attention" if device.type == "cuda" else "eager"


def run_hf(args: argparse.Namespace, shape: dict[str, Any], device: torch.device, compiled: bool) -> float:
    import transformers

    classes: dict[str, tuple[Any, Any]] = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }
    config_class, model_class = classes[shape["model_type"]]
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    config = config_class(**fields, attn_implementation=hf_attention(shape["model_type"], device))
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


def _titan_float8(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> None:
    """torchtitan's own float8 converters, as its trainer applies them before compiling.

    Linear layers: ``Float8LinearConverter`` with ``recipe_name`` and the LM head (``output``) and
    router gates filtered out (d9d's defaults). MoE experts: ``Float8GroupedMMConverter`` on
    ``experts`` (FP8 rowwise grouped GEMM; sets torchtitan's token-group alignment to 16).
    """
    from torchtitan.components.quantization.float8 import Float8GroupedMMConverter, Float8LinearConverter
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed import ParallelDims

    job = JobConfig()
    job.quantize.linear.float8.recipe_name = args.float8
    job.quantize.linear.float8.filter_fqns = ["output", "router.gate"]
    job.quantize.linear.float8.emulate = device.type != "cuda"  # its check for FP8 hardware
    job.model.converters = ["quantize.linear.float8"] if args.float8_linears else []
    experts = args.float8_experts and any(name.endswith(".experts") for name, _ in model.named_modules())
    if experts:
        job.model.converters.append("quantize.grouped_mm.float8")
        job.quantize.grouped_mm.float8.fqns = ["experts"]
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    if args.float8_linears:
        Float8LinearConverter(job, dims).convert(model)
    if experts:
        _require_titan_moe_float8()
        Float8GroupedMMConverter(job, dims).convert(model)


def _require_titan_moe_float8() -> None:
    """Names the torchao that torchtitan 0.2.2's FP8 MoE converter needs, before it fails on import.

    The converter imports ``MoETrainingConfig`` from ``torchao.prototype.moe_training``: torchao
    0.15.0 and 0.16.0 have it, 0.18.0 no longer does.
    """
    import torchao
    from torchao.prototype.moe_training import conversion_utils

    if not hasattr(conversion_utils, "MoETrainingConfig"):
        raise RuntimeError(
            f"torchtitan's FP8 MoE row needs a torchao with "
            f"torchao.prototype.moe_training.conversion_utils.MoETrainingConfig, which torchao "
            f"{torchao.__version__} lacks: install torchao 0.16.0 (d9d's FP8 rows ran on it too)"
        )


def run_titan(args: argparse.Namespace, shape: dict[str, Any], device: torch.device, amp: bool) -> float:
    """torchtitan's model and loss; ``amp``: float32 parameters under bf16 autocast, else all bf16."""
    require_torchtitan()  # a "not installed" row before any torchtitan import
    from torchtitan.components.loss import cross_entropy_loss

    model: Any = titan_model(shape, args.seq)
    if args.float8 is not None:
        _titan_float8(model, args, device)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    # all-bf16, or float32 parameters and AdamW state under autocast (GPT-OSS builds bf16 blocks)
    model.to(dtype=torch.float32 if amp else low)
    compile_titan_blocks(model, shape["model_type"])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    # seq + 1 tokens give inputs and shifted labels of seq tokens each (FP8 matmuls need the
    # token count, batch x seq, divisible by 16)
    tokens = _tokens(args, shape["vocab_size"], device, extra=1)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        # torchtitan's trainer: forward and loss under autocast when FSDP does not cast
        with torch.autocast(device.type, dtype=low, enabled=amp):
            # its loss sums over tokens; its trainer divides by the batch's valid tokens (all here)
            loss = (
                cross_entropy_loss(titan_logits(model, inputs, shape["model_type"]), labels) / labels.numel()
            )
        loss.backward()
        # its trainer clips every step (training.max_norm, default 1.0), as the d9d rows do
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    tokens_per_s, loss = _timed_plain_loop(step, args, device)
    name = _row_name(args, "titan_amp" if amp else "titan")
    extra = {"seq": args.seq, "float8_linear_layers": _float8_layers(model)}
    return _report(args, name, tokens_per_s, loss, device, extra=extra)


@dataclasses.dataclass(kw_only=True, frozen=True)
class ParallelLayout:
    """How a d9d job spreads over its ranks: the mesh, and one replica's batch split.

    Attributes:
        pp: Pipeline-parallel ranks.
        cp: Context-parallel ranks (``context_parallel_shard``: they also shard parameters).
        dp_shard: Data-parallel ranks, the ranks that ``pp`` and ``cp`` leave over.
        batch: Samples one data-parallel replica takes per step.
        microbatches: Microbatches of one replica's batch (pipeline microbatches, or gradient
            accumulation without a pipeline).
    """

    pp: int
    cp: int
    dp_shard: int
    batch: int
    microbatches: int

    @property
    def world(self) -> int:
        return self.pp * self.cp * self.dp_shard

    @property
    def global_batch(self) -> int:
        return self.batch * self.dp_shard

    @property
    def microbatch_size(self) -> int:
        return self.batch // self.microbatches


def parallel_layout(args: argparse.Namespace, world: int) -> ParallelLayout:
    """The layout ``--pp``, ``--cp``, ``--batch`` and ``--microbatches`` ask for on ``world`` ranks."""
    if world % (args.pp * args.cp) != 0:
        raise ValueError(f"--pp {args.pp} x --cp {args.cp} does not divide the {world} ranks")
    if args.batch % args.microbatches != 0:
        raise ValueError(f"--batch {args.batch} does not split into --microbatches {args.microbatches}")
    if args.pp > 1 and args.microbatches < args.pp:
        print(f"note: {args.microbatches} microbatches on {args.pp} pipeline ranks", flush=True)
    return ParallelLayout(
        pp=args.pp,
        cp=args.cp,
        dp_shard=world // (args.pp * args.cp),
        batch=args.batch,
        microbatches=args.microbatches,
    )


def pipeline_prediction(
    schedule: Any, layout: ParallelLayout, shape: dict[str, Any], seq: int
) -> dict[str, Any]:
    """The simulator's bubble of ``schedule`` and the FLOP share of each rank under its layer split.

    The simulator takes one cost per kind of action (F = 1, B = 2, I = W = 1 for every stage) and
    free transfers, so its bubble is the schedule's alone; the FLOP shares add what the stages'
    unequal work costs: the provider gives the last stage fewer decoder layers (the model config's
    ``last_stage_weight``, set to the head's weight in layers), the first stage also holds the
    embedding (a lookup, no FLOPs counted) and the last the head and loss.
    """
    from d9d.pipeline import ActionCosts, assign_layers, simulate_program

    program = schedule.build_program(num_ranks=layout.pp, num_microbatches=layout.microbatches)
    simulated = simulate_program(program, ActionCosts(forward=1.0, backward=2.0))
    layers, head = flops_of_layers_and_head(shape, seq)
    ranges = assign_layers(
        shape["num_hidden_layers"], program.num_stages, last_stage_weight=_head_weight(shape, seq)
    )
    work = [
        sum(
            sum(layers[j] for j in ranges[i.current_stage]) + (head if i.is_last else 0.0)
            for i in program.stage_infos(r)
        )
        for r in range(layout.pp)
    ]
    shares = [w / sum(work) for w in work]
    return {
        "schedule": schedule.name,
        "stages": program.num_stages,
        "predicted_bubble": simulated.bubble_fraction,
        "timeline": simulated.draw_text(width=120),
        "flop_share_per_rank": shares,
        "imbalance_bubble": 1.0 - (1.0 / layout.pp) / max(shares),
    }


def device_busy_fraction(profiler: Any, seconds: float) -> float:
    """Share of ``seconds`` in which this rank's GPU ran a kernel other than NCCL's (copies count).

    Kernels on several streams that overlap count once; NCCL kernels are left out because a
    receive's kernel spins on the GPU while it waits for its peer.
    """
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in profiler.events()
        if e.device_type == DeviceType.CUDA and "nccl" not in e.name.lower()
    )
    busy_us, reached = 0.0, -math.inf
    for begin, end in spans:
        if end > reached:
            busy_us += end - max(begin, reached)
            reached = end
    return busy_us / 1e6 / seconds if seconds > 0 else float("nan")


def load_reference(
    args: argparse.Namespace, implementation: str, layout: ParallelLayout
) -> dict[str, Any] | None:
    """The last one-process record of ``implementation`` that did one replica's work of this run.

    That is the same sequence length, batch (``--batch``: samples per data-parallel replica) and
    microbatch size, so the per-GPU comparison leaves out nothing but the parallelism.
    """
    if args.reference_json is None:
        return None
    path = Path(args.reference_json)
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    matches = [
        r
        for r in records
        if r.get("implementation") == implementation
        and r.get("world_size") == 1
        and r.get("seq") == args.seq
        and r.get("microbatch_size") == layout.microbatch_size
        and r.get("global_batch") == layout.batch
    ]
    if not matches:
        print(
            f"no reference in {path}: no one-process {implementation} record with seq {args.seq}, "
            f"batch {layout.batch} and microbatch size {layout.microbatch_size}",
            flush=True,
        )
        return None
    return matches[-1]


def compare(
    record: dict[str, Any], layout: ParallelLayout, reference: dict[str, Any] | None
) -> tuple[dict[str, Any], list[str]]:
    """The figures of ``record`` against its one-process ``reference``: fields and printed lines."""
    world = layout.world
    per_gpu = record["tokens_per_s"] / world
    mesh = f"pp={layout.pp} cp={layout.cp} dp_shard={layout.dp_shard}"
    lines = [
        f"{record['implementation']} on {world} rank(s) ({mesh}), seq {record['seq']}, global batch "
        f"{layout.global_batch} in microbatches of {layout.microbatch_size}: "
        f"{record['tokens_per_s']:.0f} tok/s, "
        f"{per_gpu:.0f} tok/s per GPU; step {record['step_ms']:.1f} ms (forward-backward "
        f"{record['forward_backward_ms']:.1f} ms, optimizer {record['optimizer_ms']:.1f} ms)"
    ]
    fields: dict[str, Any] = {}
    pipeline = record.get("pipeline")
    if pipeline is not None:
        shares = " / ".join(f"{s:.1%}" for s in pipeline["flop_share_per_rank"])
        lines += [
            f"pipeline {pipeline['schedule']}: {layout.pp} ranks, {pipeline['stages']} stages, "
            f"{layout.microbatches} microbatches",
            f"  predicted bubble (d9d-pipeline simulator, F=1 B=2 I=W=1 per stage, balanced stages, "
            f"free transfers): {pipeline['predicted_bubble']:.1%}",
            *("    " + row for row in pipeline["timeline"].splitlines()),
            f"  FLOP share per rank (layers split with the head weighed as layers; the first stage "
            f"adds the embedding, the last the head and loss): {shares}; that imbalance alone idles "
            f"{pipeline['imbalance_bubble']:.1%}",
        ]
    idle = record.get("device_idle_per_rank")
    if reference is None:
        if idle is not None:
            lines.append("GPU idle per rank (profiled steps): " + ", ".join(f"{i:.1%}" for i in idle))
        return fields, lines
    ref_tps = reference["tokens_per_s"]
    fields["reference_tokens_per_s"] = ref_tps
    fields["speedup"] = record["tokens_per_s"] / ref_tps
    lines.append(
        f"one GPU, same seq, batch and microbatch size: "
        f"{ref_tps:.0f} tok/s "
        f"-> {fields['speedup']:.2f}x on {world} GPUs, per-GPU tok/s {per_gpu / ref_tps:.1%} of one GPU's"
    )
    if pipeline is not None:
        # the one-process time of this replica's batch, spread perfectly over the pipeline ranks
        scale = layout.batch / reference["global_batch"] / (layout.pp * layout.cp)
        ideal_fb = reference["forward_backward_ms"] * scale
        fields["measured_bubble_step"] = 1.0 - per_gpu / ref_tps
        fields["measured_bubble_forward_backward"] = 1.0 - ideal_fb / record["forward_backward_ms"]
        lines += [
            f"  measured bubble, forward-backward phase: 1 - (one GPU's "
            f"{reference['forward_backward_ms']:.1f} ms"
            f" x {scale:.3g}) / {record['forward_backward_ms']:.1f} ms = "
            f"{fields['measured_bubble_forward_backward']:.1%}; includes the schedule's bubble, P2P "
            f"transfers and their waits, the stage imbalance above, and per-action host overhead",
            f"  measured bubble, whole step: 1 - per-GPU tok/s / one GPU's = "
            f"{fields['measured_bubble_step']:.1%}"
            f"; adds the optimizer phase (a tied embedding keeps a copy on the last stage: one more "
            f"vocab x hidden matrix to step, and a gradient sum across the pipeline)",
        ]
    if idle is not None:
        ref_idle = (reference.get("device_idle_per_rank") or [None])[0]
        lines.append(
            "GPU idle per rank (profiled steps, non-NCCL kernels over wall time): "
            + ", ".join(f"r{r} {i:.1%}" for r, i in enumerate(idle))
            + ("" if ref_idle is None else f"; one GPU: {ref_idle:.1%}")
        )
    return fields, lines


def _head_weight(shape: dict[str, Any], seq: int) -> float:
    """The head's (and loss's) training FLOPs in mean decoder layers: the last pipeline stage's extra cost."""
    layers, head = flops_of_layers_and_head(shape, seq)
    return head / (sum(layers) / len(layers))


def _float8_layers(model: torch.nn.Module) -> int:
    """How many of ``model``'s linear layers torchao converted (0 without torchao)."""
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def _row_name(
    args: argparse.Namespace, implementation: str, *, fp8: bool | None = None, read_figures: str | None = None
) -> str:
    """The table's name of a row: ``<implementation>[_bf16state][_late][_fp8]`` (``--d9d-state``;
    ``_late`` when d9d reads a step's figures during the next step; FP8 when ``fp8``, by default
    when ``--float8`` is given)."""
    d9d = implementation.startswith("d9d")
    state = "_bf16state" if d9d and args.d9d_state == "bfloat16" else ""
    read_figures = args.read_figures[0] if read_figures is None else read_figures
    late = "_late" if d9d and read_figures == "during_next_step" else ""
    fp8 = args.float8 is not None if fp8 is None else fp8
    return implementation + state + late + (FLOAT8_SUFFIX if fp8 else "")


def _d9d_float8(args: argparse.Namespace, shape: dict[str, Any]) -> dict[str, Any]:
    """The model config's ``float8`` section for ``--float8`` (experts on the MoE shape)."""
    section: dict[str, Any] = {"recipe": args.float8}
    if args.device != "cuda":
        section["emulate"] = True
    if args.quick:
        section["min_features"] = 16  # the tiny shape's layers convert too
    if shape["model_type"] == "qwen3_moe" and args.float8_experts:
        section["experts"] = True
        section["expert_weight_casts"] = args.expert_weight_casts
    if not args.float8_linears:
        section["exclude"] = [".*"]  # every linear layer stays bf16: the experts alone in FP8
    return section


class _Mark:
    """A point in a step: an event on the device's stream on a GPU, the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self._event: Any = None
        self._host = time.perf_counter()
        if device.type == "cuda":
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()

    def seconds_to(self, later: _Mark) -> float:
        """Seconds from this mark to ``later`` (both recorded; on a GPU, after a device sync)."""
        if self._event is not None and later._event is not None:
            return self._event.elapsed_time(later._event) / 1e3
        return later._host - self._host


def run_d9d(args: argparse.Namespace, shape: dict[str, Any], device: torch.device, compiled: bool) -> float:
    from d9d.hf import HFModelProvider, ScratchModelConfig, TokenBatch, causal_lm_task
    from d9d.loop import (
        AutoDataProvider,
        AutoLRSchedulerProvider,
        AutoOptimizerProvider,
        OptimizerStepStarted,
        ProjectConfig,
        StepFinished,
        StepStarted,
        TrainingConfigurator,
    )

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    layout = parallel_layout(args, world)
    name = _row_name(args, "d9d_compile" if compiled else "d9d")
    profiled = 2 if args.profile or args.busy or args.trace is not None else 0
    # At least one step after the timed ones: the last timed step ends where the next one starts,
    # never at the end of train(), whose teardown (measured: 0 to 560 ms) is no step's time.
    total_steps = args.warmup + args.steps + max(profiled, 1)
    trainer: dict[str, Any] = {
        "max_steps": total_steps,
        "global_batch_size": layout.global_batch,
        "microbatch_size": layout.microbatch_size,
        "logging": {"progress_bar": False, "read_figures": args.read_figures[0]},
        "device": device.type,
        "initialization": {"layout_invariant": False},
        "gradient_clipping": {"max_norm": 1.0},
    }
    if layout.pp > 1:
        trainer["pipeline"] = {"name": args.schedule}
    config = ProjectConfig.model_validate(
        {
            "mesh": {
                "pipeline_parallel": layout.pp,
                "context_parallel_shard": layout.cp,
                "data_parallel_shard": layout.dp_shard,
            },
            "trainer": trainer,
            "optimizer": (
                {"name": "adamw", "lr": 1e-4, "weight_decay": 0.0}
                if args.d9d_state == "float32"
                else {"name": "stochastic_adamw", "lr": 1e-4, "weight_decay": 0.0, "state_dtype": "bfloat16"}
            ),
        }
    )
    pipeline = (
        pipeline_prediction(config.trainer.pipeline, layout, shape, args.seq) if layout.pp > 1 else None
    )
    reference = load_reference(args, name, layout) if rank == 0 else None
    model = ScratchModelConfig.model_validate(
        {
            "config": shape,
            "param_dtype": "bfloat16" if device.type == "cuda" else None,
            "master_dtype": args.d9d_state,
            "compile": compiled,
            "last_stage_weight": _head_weight(shape, args.seq) if args.pp > 1 else 0.0,
            "attention_backend": args.attention_backend,
            **({} if args.float8 is None else {"float8": _d9d_float8(args, shape)}),
        }
    )
    times: list[float] = []
    losses: list[float] = []
    peaks: list[float] = []
    busy: list[float] = []
    window: list[float] = []

    profiler: Any = None
    # Steps and their phases are timed at marks: on a GPU events on the stream (the loop's clocks
    # are host clocks, and the host waits for the device only once per step), on a CPU the host
    # clock. A mark at the start of each step and one when the optimizer is about to step (forward,
    # backward and clipping queued); a step ends where the next one starts (the events of a step
    # whose figures are read late come during the next step).
    marks: list[list[_Mark]] = []

    def mark(loop_event: object) -> None:
        if isinstance(loop_event, StepStarted):
            marks.append([])
        marks[-1].append(_Mark(device))

    def on_step(event: StepFinished) -> None:
        nonlocal profiler
        times.append(time.perf_counter())
        losses.append(event.metrics["loss"])
        # the loop reads and resets the allocator's peak every step: take its per-step figure
        peaks.append(event.metrics.get("memory/peak_gib", float("nan")))
        if not args.busy and args.trace is None and not (args.profile and rank == 0):
            return
        if event.step == args.warmup + args.steps - 1:  # two extra steps after the timed ones
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
            window.append(time.perf_counter())
        elif profiler is not None and event.step == args.warmup + args.steps + 1:
            window.append(times[-1])  # the loop synced the device when it read the gradient norm
            _sync(device)
            profiler.__exit__(None, None, None)
            if args.busy:
                busy.append(device_busy_fraction(profiler, window[1] - window[0]))
            if args.profile and rank == 0:
                _print_profile(profiler, device)
            if args.trace is not None:
                profiler.export_chrome_trace(f"{args.trace}.rank{rank}.json")
            profiler = None

    with TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _ctx: RandomTokens(
                total_steps * layout.global_batch, args.seq, shape["vocab_size"], documents=args.documents
            ),
            collator=TokenBatch.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure() as trainer_:
        trainer_.events.subscribe(StepStarted, mark)
        trainer_.events.subscribe(OptimizerStepStarted, mark)
        trainer_.events.subscribe(StepFinished, on_step)
        float8_layers = sum(_float8_layers(stage) for stage in trainer_.model_stages)
        trainer_.train()
        mark(StepStarted(step=total_steps))  # the end of the last step
        _sync(device)
        idle: list[float] | None = None
        if args.busy:  # every rank's figure, gathered while the process group is still up
            gathered: list[Any] = [None] * world
            if world > 1:
                torch.distributed.all_gather_object(gathered, 1.0 - busy[0])
            else:
                gathered = [1.0 - busy[0]]
            idle = [float(i) for i in gathered]
    timed = slice(args.warmup, args.warmup + args.steps)
    # the phases (the device synced above): step start to optimizer, optimizer to the next start
    phases = [
        (start.seconds_to(optimizer), optimizer.seconds_to(end))
        for (start, optimizer, *_), (end, *_) in itertools.pairwise(marks)
    ]
    # From the mark at the start of the first timed step to the one after the last: on a GPU the
    # device's time for those steps, idle included, the same whenever the host reads the figures.
    # (The host clock at StepFinished is not: with read_figures=during_next_step a step's event
    # comes when the host reaches the next step's read, but the run's last step is read at its end.)
    elapsed = marks[args.warmup][0].seconds_to(marks[args.warmup + args.steps][0])
    tokens_per_s = layout.global_batch * args.seq * args.steps / elapsed
    record: dict[str, Any] = {
        "mesh": {"pp": layout.pp, "cp": layout.cp, "dp_shard": layout.dp_shard},
        "seq": args.seq,
        "documents_per_row": args.documents,
        "global_batch": layout.global_batch,
        "microbatches": layout.microbatches,
        "microbatch_size": layout.microbatch_size,
        "step_ms": 1e3 * elapsed / args.steps,
        "forward_backward_ms": 1e3 * sum(p[0] for p in phases[timed]) / args.steps,
        "optimizer_ms": 1e3 * sum(p[1] for p in phases[timed]) / args.steps,
        # per timed step: an outlier (a stalled host while the device waits) shows here
        "phases_ms": [[round(1e3 * a, 1), round(1e3 * b, 1)] for a, b in phases[timed]],
        "tokens_per_s_per_gpu": tokens_per_s / world,
        "device_idle_per_rank": idle,
        "pipeline": pipeline,
        "float8_linear_layers": float8_layers,
    }
    if rank == 0:
        fields, lines = compare(
            {"implementation": name, "tokens_per_s": tokens_per_s, **record}, layout, reference
        )
        record |= fields
        print("\n".join(lines), flush=True)
    return _report(
        args,
        name,
        tokens_per_s,
        losses[-1],
        device,
        world=world,
        peak_gib=max(peaks, default=float("nan")),
        extra=record,
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
    extra: dict[str, Any] | None = None,
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
        line = json.dumps({**dataclasses.asdict(result), **(extra or {"seq": args.seq})})
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
    if args.float8 is not None and args.impl not in FLOAT8_IMPLEMENTATIONS:
        raise ValueError(f"--float8 applies to {', '.join(FLOAT8_IMPLEMENTATIONS)}, not {args.impl}")
    if not args.impl.startswith("d9d") and (args.pp > 1 or args.cp > 1 or args.microbatches > 1):
        raise ValueError(
            f"--pp, --cp and --microbatches are options of the d9d implementations, not {args.impl}"
        )
    match args.impl:
        case "hf":
            run_hf(args, shape, device, compiled=False)
        case "hf_compile":
            run_hf(args, shape, device, compiled=True)
        case "titan":
            run_titan(args, shape, device, amp=False)
        case "titan_amp":
            run_titan(args, shape, device, amp=True)
        case "d9d":
            run_d9d(args, shape, device, compiled=False)
        case "d9d_compile":
            run_d9d(args, shape, device, compiled=True)
        case _:
            raise ValueError(f"unknown implementation {args.impl!r}")


def _planned_runs(args: argparse.Namespace, shape: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(implementation, in FP8, d9d's ``read_figures``) of every row of a round, in order.

    Without ``--float8``: ``--only`` or every implementation, in bf16. With it: the first d9d
    implementation in bf16 as the baseline, then each FP8-capable implementation of ``--only``
    (default: all of them) in FP8; others named in ``--only`` run as they are. Each d9d row runs
    once per ``--read-figures`` mode. torchtitan rows are left out for a family it does not ship.
    """
    if not args.only and shape["model_type"] not in TITAN_FAMILIES:
        print(f"note: torchtitan has no {shape['model_type']} model; no titan rows", flush=True)
        args = argparse.Namespace(
            **{**vars(args), "only": [i for i in IMPLEMENTATIONS if not i.startswith("titan")]}
        )
    if args.float8 is None:
        runs = [(name, False) for name in args.only or IMPLEMENTATIONS]
    else:
        names = list(args.only or FLOAT8_IMPLEMENTATIONS)
        runs = [(name, name in FLOAT8_IMPLEMENTATIONS) for name in names]
        d9d_rows = [name for name in names if name.startswith("d9d")]
        if d9d_rows and args.bf16_baseline:
            runs.insert(0, (d9d_rows[0], False))  # the first d9d row, in bf16
    return [
        (name, fp8, mode)
        for name, fp8 in runs
        for mode in (args.read_figures if name.startswith("d9d") else args.read_figures[:1])
    ]


NOT_RUN_EXIT = 3
"""A child's exit status when its implementation cannot run here (a peer not installed)."""
NOT_RUN_PREFIX = "NOT RUN: "


def _child_command(
    args: argparse.Namespace, impl: str, fp8: bool, mode: str, scratch: Path, *, profiled: bool
) -> list[str]:
    """The command line of one row's process."""
    command = [sys.executable, __file__, "--impl", impl, "--json", str(scratch)]
    command += [
        f"--{k}={v}"
        for k, v in vars(args).items()
        if k in ("model", "device", "seq", "batch", "steps", "warmup")
    ]
    if args.attention_backend is not None and impl.startswith("d9d"):
        command.append(f"--attention-backend={args.attention_backend}")
    if impl.startswith("d9d"):
        command += [
            f"--d9d-state={args.d9d_state}",
            f"--read-figures={mode}",
            f"--documents={args.documents}",
        ]
    command += ["--quick"] if args.quick else []
    if fp8:
        command += [f"--float8={args.float8}"]
        command += [] if args.float8_experts else ["--no-float8-experts"]
        command += [] if args.float8_linears else ["--no-float8-linears"]
        command += [f"--expert-weight-casts={args.expert_weight_casts}"]
    return command + (["--profile"] if profiled else [])


def _run_child(command: list[str], name: str, scratch: Path, args: argparse.Namespace, profiled: bool) -> Any:
    """One row's record, the reason it did not run (a string), or None when it failed (printed)."""
    scratch.unlink(missing_ok=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:  # the child is killed; the other rows still run
        print(f"{name}: no result within --timeout {args.timeout:.0f} s", flush=True)
        return None
    if profiled:
        print(done.stdout[-12000:], flush=True)
    if done.returncode == NOT_RUN_EXIT:
        reason = next(line for line in done.stdout.splitlines() if line.startswith(NOT_RUN_PREFIX))
        print(f"{name}: {reason}", flush=True)
        return reason.removeprefix(NOT_RUN_PREFIX)
    if done.returncode != 0 or not scratch.exists():
        print(
            f"{name}: FAILED after {time.perf_counter() - started:.0f} s\n{done.stderr[-2500:]}", flush=True
        )
        return None
    return json.loads(scratch.read_text().splitlines()[-1])


def run_all(args: argparse.Namespace) -> None:
    """Runs every implementation in its own process, ``--repeats`` rounds in turn; prints the table.

    Rounds alternate the implementations (a, b, c, a, b, c, ...) so that a slow phase of the
    machine hits each alike; a ratio against a peer (torchtitan, compiled transformers) is taken
    within each round and the table gives its median over the rounds with the range. A shape
    with an issue's goal (``GOALS``) gets a line per d9d row saying whether it is met.
    """
    device = torch.device(args.device)
    peak = measure_peak_tflops(device)
    shape = model_shape(args.model, args.quick)
    flops = flops_per_token(shape, args.seq)
    runs = _planned_runs(args, shape)
    names = [_row_name(args, impl, fp8=fp8, read_figures=mode) for impl, fp8, mode in runs]
    rounds: list[dict[str, Any]] = []
    scratch = Path(f"/tmp/d9d_throughput_{os.getpid()}.jsonl")
    for round_index in range(args.repeats):
        records: dict[str, Any] = {}
        for (impl, fp8, mode), name in zip(runs, names, strict=True):
            profiled = args.profile and not impl.startswith("hf") and round_index == 0
            command = _child_command(args, impl, fp8, mode, scratch, profiled=profiled)
            record = _run_child(command, name, scratch, args, profiled)
            if record is None:
                continue
            records[name] = record
            if isinstance(record, dict):
                print(
                    f"round {round_index + 1}: {name} {record['tokens_per_s'] / 1e3:.1f}k tok/s", flush=True
                )
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(record) + "\n")
        rounds.append(records)
    print(
        f"\n{shape['model_type']} {args.model} ({shape['num_hidden_layers']} layers), "
        f"seq {args.seq}, batch {args.batch}, "
        f"{args.device}; bf16 matmul peak measured: {peak:.0f} TFLOP/s; {flops / 1e9:.2f} GFLOP/token; "
        f"{args.repeats} round(s): median (min-max)"
    )
    print("\n".join(table_lines(names, rounds, flops_per_token=flops, peak_tflops=peak)))
    goal = GOALS.get(args.model)
    if goal is not None:
        print("\n".join(goal_lines(goal, names, rounds, d9d_state=args.d9d_state)), flush=True)


def pipeline_schedules() -> list[str]:
    """The training schedules d9d-loop's ``trainer.pipeline.name`` accepts."""
    from d9d.pipeline import PipelineScheduleConfig

    configs = typing.get_args(typing.get_args(PipelineScheduleConfig)[0])
    return [
        c.model_fields["name"].default for c in configs if c.model_fields["name"].default != "forward_only"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--impl", choices=[*IMPLEMENTATIONS, "all"], default="all")
    parser.add_argument("--only", nargs="*", choices=IMPLEMENTATIONS, help="with --impl all: these only")
    parser.add_argument(
        "--model",
        choices=list(SHAPES),
        default="dense",
        help=SHAPE_HELP,
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --impl all: rounds, each running every implementation once in turn; the table "
        "gives each figure as the median over rounds with its range",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="d9d: an attention backend name (default: auto, SDPA on CUDA)",
    )
    parser.add_argument(
        "--documents",
        type=int,
        default=1,
        help="d9d rows only: pack this many equal documents into every row (document_ids), as a "
        "packed fine-tuning batch; compare attention backends with --attention-backend",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny model, for a smoke run")
    parser.add_argument("--json", help="append each result as a JSON line here")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="d9d and torchtitan rows (first round): print the top kernels of two extra steps",
    )
    parser.add_argument(
        "--trace",
        default=None,
        help="d9d: profile two extra steps and write their Chrome trace to <TRACE>.rank<R>.json "
        "(summarize it with step_gaps.py)",
    )
    parser.add_argument("--pp", type=int, default=1, help="d9d: pipeline-parallel ranks")
    parser.add_argument("--schedule", choices=pipeline_schedules(), default="1f1b", help="d9d: with --pp")
    parser.add_argument(
        "--microbatches", type=int, default=1, help="d9d: microbatches of a replica's batch per step"
    )
    parser.add_argument(
        "--cp", type=int, default=1, help="d9d: context-parallel ranks (context_parallel_shard)"
    )
    parser.add_argument(
        "--busy", action="store_true", help="d9d: profile two extra steps on every rank, report GPU idle time"
    )
    parser.add_argument(
        "--reference-json", help="d9d: a file of one-process results to compare with (see the usage above)"
    )
    parser.add_argument(
        "--float8",
        choices=["tensorwise", "rowwise"],
        default=None,
        help="train the d9d and torchtitan rows' linear layers in FP8 with this torchao recipe (rows "
        "named <row>_fp8; see above)",
    )
    parser.add_argument(
        "--float8-experts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --float8 on the MoE shape: the experts' grouped GEMMs in FP8 rowwise too",
    )
    parser.add_argument(
        "--float8-linears",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --float8: the attention and MLP projections in FP8 (off with --float8-experts on the "
        "MoE shape: the experts alone in FP8, every linear layer in bf16)",
    )
    parser.add_argument(
        "--expert-weight-casts",
        choices=["per_microbatch", "per_step"],
        default="per_microbatch",
        help="d9d rows with FP8 experts: model.float8.expert_weight_casts (per_step keeps the "
        "experts' weight casts across a step's --microbatches)",
    )
    parser.add_argument(
        "--d9d-state",
        choices=["float32", "bfloat16"],
        default="float32",
        help="d9d rows: float32 master weights and AdamW state (default), or bf16 parameters "
        "(model.master_dtype) stepped by stochastic_adamw with bf16 moments, the state torchtitan's "
        "'titan' row keeps (rows named <row>_bf16state)",
    )
    parser.add_argument(
        "--read-figures",
        nargs="+",
        choices=["after_step", "during_next_step"],
        default=["after_step"],
        help="d9d rows: trainer.logging.read_figures; with several, each d9d row runs once per mode "
        "(during_next_step rows are named <row>_late)",
    )
    parser.add_argument(
        "--bf16-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --float8 and --impl all: also run d9d in bf16 first",
    )
    args = parser.parse_args()
    if not args.float8_linears and (args.float8 is None or not args.float8_experts):
        parser.error("--no-float8-linears needs --float8 and --float8-experts: the experts alone in FP8")
    if args.documents < 1 or args.seq % args.documents:
        parser.error(f"--documents={args.documents} must be at least 1 and divide --seq={args.seq}")
    packs_d9d_only = args.impl.startswith("d9d") or (
        args.impl == "all" and bool(args.only) and all(i.startswith("d9d") for i in args.only)
    )
    if args.documents > 1 and not packs_d9d_only:
        parser.error("--documents packs the d9d rows only: pick them with --impl or --only")
    if args.impl == "all":
        run_all(args)
        return
    try:
        run_one(args)
    except PeerNotInstalledError as missing:  # a row of the table, not a crash
        print(f"{NOT_RUN_PREFIX}{missing}", flush=True)
        sys.exit(NOT_RUN_EXIT)


if __name__ == "__main__":
    main()
