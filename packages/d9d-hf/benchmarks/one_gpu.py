"""Fine-tuning on one memory-capped GPU: d9d against transformers + PEFT + Liger, same shapes, same data.

Each job runs in its own process under ``torch.cuda.set_per_process_memory_fraction`` (a 24 GiB
card on an H200 by default), on random tokens and randomly initialized weights of the real
widths (no download), and reports tokens/s and memory by phase: after the model is built, the
peak of step 0, and the steady steps' peak allocated and reserved memory.

    python one_gpu.py --jobs lora8b full1p7b                       # d9d and the peer, 3 rounds
    python one_gpu.py --jobs lora8b --impls d9d --rounds 1 --snapshot   # where the memory goes
    python one_gpu.py --quick --device cpu --jobs lora8b --impls d9d    # a CPU smoke run
    python one_gpu.py --jobs lora8b --impls d9d --rounds 1 --profile traces   # then step_gaps.py

Jobs (seq 4096, batch 1 by default):

* ``lora8b``: Qwen3-8B widths, LoRA r16 (alpha 32) on all seven projections, bf16 frozen base.
* ``full1p7b`` / ``full4b``: Qwen3-1.7B / Qwen3-4B widths, every parameter trained.
* ``full4b_offload``: ``full4b`` with d9d's optimizer moments in pinned host memory but 4 GiB
  of them (``optimizer.offload: {resident_mib: 4096}``); run it with ``--impls d9d`` and compare
  it with ``full4b`` at ``--cap-gib 141`` for the cost of the offload.
* ``qlora14b``: Qwen3-14B widths, LoRA r16 on all seven projections over a frozen NF4 base
  (``trainer.peft.base: {kind: nf4}``; needs bitsandbytes); d9d only.
* For bigger cards (pass ``--cap-gib 48``, ``80`` or ``141``): ``full8b`` / ``full14b`` (Qwen3-8B /
  Qwen3-14B widths, every parameter trained) and ``lora14b`` / ``lora32b`` (LoRA r16 on all seven
  projections, bf16 base).

d9d runs its whole job (config -> TrainingConfigurator -> Trainer) with activation checkpointing,
``compile: true``, bf16 parameters as the master weights (``master_dtype: bfloat16``) and
``stochastic_adamw`` with bf16 moments. The peer (``hf``) is transformers' Qwen3ForCausalLM with
gradient checkpointing, PEFT's LoRA for the LoRA job, Liger's Qwen3 kernels (its fused linear
cross-entropy among them) and torch's fused AdamW on the bf16 trainable parameters.
The second peer (``trl``) runs the same model, data and switches through TRL's ``SFTTrainer``
(``use_liger_kernel``, ``adamw_torch_fused``, pre-tokenized rows, no packing).

Each run reports the tokens/s of its timed window and of its median step (``step_s`` lists every
step's seconds), and for d9d the Python collections over 20 ms (``gc_pauses``: step, generation,
ms); ``--gc-every N`` sets d9d's ``trainer.garbage_collection.every_steps``.

``--snapshot`` records the allocator's history and, at an out-of-memory error or at the end,
prints the largest live blocks with the code that allocated them. On the H200 (torch 2.11) the
history recording made compiled d9d steps fail with ``SystemError: ... returned NULL`` in three of
four runs: use it to find where memory goes, never for timing.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _random_tokens import RandomTokens
from _stats import spread

GIB = 2**30
QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
}
QWEN3_1P7B: dict[str, Any] = {
    **QWEN3_8B,
    "hidden_size": 2048,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "intermediate_size": 6144,
    "tie_word_embeddings": True,
}
QWEN3_4B: dict[str, Any] = {
    **QWEN3_8B,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "tie_word_embeddings": True,
}
QWEN3_14B: dict[str, Any] = {
    **QWEN3_8B,
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "intermediate_size": 17408,
}
QWEN3_32B: dict[str, Any] = {
    **QWEN3_14B,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "intermediate_size": 25600,
}
QUICK: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
JOBS: dict[str, tuple[dict[str, Any], bool]] = {
    "lora8b": (QWEN3_8B, True),
    "full1p7b": (QWEN3_1P7B, False),
    "full4b": (QWEN3_4B, False),
    "full4b_offload": (QWEN3_4B, False),
    "qlora14b": (QWEN3_14B, True),
    # bigger cards (run with --cap-gib 48 / 80 / 141)
    "full8b": (QWEN3_8B, False),
    "full14b": (QWEN3_14B, False),
    "lora14b": (QWEN3_14B, True),
    "lora32b": (QWEN3_32B, True),
}
# d9d stores the adapted projections' frozen base in NF4 (trainer.peft.base)
NF4_JOBS = frozenset({"qlora14b"})
# d9d keeps the optimizer's moments in host memory (optimizer.offload), 4 GiB of them on the device
OFFLOADED: dict[str, dict[str, Any]] = {"full4b_offload": {"resident_mib": 4096}}
IMPLS = ("d9d", "hf", "trl")


def _shape(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    shape, lora = JOBS[args.job]
    return ({**shape, **QUICK} if args.quick else dict(shape)), lora


def _cap(args: argparse.Namespace, device: torch.device) -> None:
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total), device.index or 0)
    if args.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)  # pyright: ignore[reportPrivateUsage]


def _memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {"allocated_gib": float("nan"), "reserved_gib": float("nan"), "peak_gib": float("nan")}
    return {
        "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
    }


def print_largest_blocks(limit: int = 25) -> None:
    """The largest live allocations of the recorded history, each with its innermost project frames."""
    snapshot: Any = torch.cuda.memory._snapshot()  # pyright: ignore[reportPrivateUsage]
    blocks: list[tuple[int, list[str]]] = []
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [
                f"{Path(f['filename']).name}:{f['line']} {f['name']}"
                for f in block.get("frames", [])
                if ("d9d" in f["filename"] or "peft" in f["filename"] or "liger" in f["filename"]
                    or "transformers" in f["filename"] or "torch/optim" in f["filename"]
                    or "autograd" in f["filename"])
            ]  # fmt: skip
            blocks.append((block["size"], frames[:5]))
    blocks.sort(key=lambda b: -b[0])
    total = sum(size for size, _ in blocks)
    print(f"live: {total / GIB:.2f} GiB in {len(blocks)} blocks; the largest:", flush=True)
    for size, frames in blocks[:limit]:
        print(f"  {size / GIB:7.3f} GiB  {' <- '.join(frames) or '(no project frame)'}", flush=True)


def _tokens(args: argparse.Namespace, vocab: int, step: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)


def _record_gc_pauses(marks: list[float]) -> list[tuple[int, int, float]]:
    """Python's collections over 20 ms as (step they fell in, generation, ms), recorded from now on."""
    pauses: list[tuple[int, int, float]] = []
    started: list[float] = []

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            ms = (time.perf_counter() - started[0]) * 1e3
            if ms > 20:
                pauses.append((len(marks), int(info["generation"]), round(ms, 1)))

    gc.callbacks.append(on_collection)
    return pauses


def run_d9d(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from d9d.hf import HFModelProvider, ScratchModelConfig, TokenBatch, causal_lm_task
    from d9d.loop import (
        AutoDataProvider,
        AutoLRSchedulerProvider,
        AutoOptimizerProvider,
        ProjectConfig,
        StepFinished,
        TrainingConfigurator,
    )

    shape, lora = _shape(args)
    steps = args.warmup + args.steps
    trainer: dict[str, Any] = {
        "max_steps": steps,
        "global_batch_size": args.batch,
        "microbatch_size": args.batch,
        "logging": {"progress_bar": False},
        "device": device.type,
        "gradient_clipping": {"max_norm": 1.0},
    }
    if args.gc_every:
        trainer["garbage_collection"] = {"every_steps": args.gc_every}
    if args.profile:
        trainer["profiling"] = {"start_step": args.warmup, "steps": 2, "directory": args.profile}
    if lora:
        trainer["peft"] = {"kind": "lora", "target": "|".join(PROJECTIONS), "r": 16, "alpha": 32.0}
        if args.job in NF4_JOBS:
            trainer["peft"]["base"] = {"kind": "nf4", "block_size": 64, "double_quant": True}
    config = ProjectConfig.model_validate(
        {
            "trainer": trainer,
            "optimizer": {
                "name": "stochastic_adamw",
                "lr": 1e-5,
                "weight_decay": 0.0,
                "state_dtype": "bfloat16",
                **({"offload": OFFLOADED[args.job]} if args.job in OFFLOADED else {}),
            },
        }
    )
    model = ScratchModelConfig.model_validate(
        {
            "config": shape,
            "param_dtype": "bfloat16" if device.type == "cuda" else None,
            "master_dtype": "bfloat16" if device.type == "cuda" else "float32",
            "compile": device.type == "cuda",
            "activation_checkpointing": not args.no_recompute,
        }
    )
    marks: list[float] = []
    per_step: list[dict[str, float]] = []

    def on_step(event: StepFinished) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
        # the loop reads (and resets) the allocator's peak at each step's end: its figure is the step's
        per_step.append({**_memory(device), "peak_gib": event.metrics.get("memory/peak_gib", float("nan"))})

    result: dict[str, Any] = {"impl": "d9d", "job": args.job}
    pauses = _record_gc_pauses(marks)
    result["gc_pauses"] = pauses
    try:
        with TrainingConfigurator(
            mesh=config.mesh,
            parameters=config.trainer,
            model_provider=HFModelProvider(model),
            task_provider=causal_lm_task,
            data_provider=AutoDataProvider(
                dataset_factory=lambda _ctx: RandomTokens(steps * args.batch, args.seq, shape["vocab_size"]),
                collator=TokenBatch.collate,
                config=config.data,
            ),
            optimizer_provider=AutoOptimizerProvider(config.optimizer),
            lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        ).configure() as trainer_:
            result["built"] = _memory(device)
            trainer_.events.subscribe(StepFinished, on_step)
            trainer_.train()
    except Exception as e:  # the loop may wrap the allocator's error
        if "out of memory" not in str(e).lower():
            raise
        result["error"] = f"out of memory after {len(per_step)} steps: {str(e).splitlines()[0]}"
        if args.snapshot:
            print_largest_blocks()
        return result
    if args.snapshot:
        print_largest_blocks()
    return _finish(result, args, marks, per_step)


def _hf_model(shape: dict[str, Any], device: torch.device) -> Any:
    """transformers' Qwen3ForCausalLM of ``shape``, random, built on ``device`` in the compute dtype."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {k: v for k, v in shape.items() if k != "model_type"}
    default = torch.get_default_dtype()
    # built in bf16: a float32 8B would not fit the cap
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(Qwen3Config(**fields))
    finally:
        torch.set_default_dtype(default)


def run_hf(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape, lora = _shape(args)
    result: dict[str, Any] = {"impl": "hf", "job": args.job}
    if device.type == "cuda":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3()
    marks: list[float] = []
    per_step: list[dict[str, float]] = []
    try:
        model: Any = _hf_model(shape, device)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(PROJECTIONS)))
            model.enable_input_require_grads()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=0.0, fused=device.type == "cuda")
        result["built"] = _memory(device)
        for step in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            tokens = _tokens(args, shape["vocab_size"], step, device)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            float(loss)
            marks.append(time.perf_counter())
            per_step.append({**_memory(device)})
    except Exception as e:  # the loop may wrap the allocator's error
        if "out of memory" not in str(e).lower():
            raise
        result["error"] = f"out of memory after {len(per_step)} steps: {str(e).splitlines()[0]}"
        if args.snapshot:
            print_largest_blocks()
        return result
    return _finish(result, args, marks, per_step)


def run_trl(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """TRL's SFTTrainer on the same model, data and switches as ``run_hf`` (its own loop, via accelerate)."""
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    shape, lora = _shape(args)
    result: dict[str, Any] = {"impl": "trl", "job": args.job}
    steps = args.warmup + args.steps
    rows = [_tokens(args, shape["vocab_size"], step, torch.device("cpu")) for step in range(steps)]
    dataset = Dataset.from_dict({"input_ids": [row[i].tolist() for row in rows for i in range(args.batch)]})
    # pre-tokenized rows: the tokenizer only lends its pad and eos ids to the collator
    words = WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(words), pad_token="<pad>", eos_token="<eos>"
    )
    marks: list[float] = []
    per_step: list[dict[str, float]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

        def on_step_end(self, *_: Any, **__: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            marks.append(time.perf_counter())
            per_step.append({**_memory(device)})

    config = SFTConfig(
        output_dir="/tmp/one_gpu_trl",
        max_steps=steps,
        per_device_train_batch_size=args.batch,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=device.type == "cuda",
        use_cpu=device.type != "cuda",
        use_liger_kernel=device.type == "cuda",
        optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
        learning_rate=1e-5,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        max_length=args.seq,
        packing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        dataloader_num_workers=0,
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=list(PROJECTIONS), task_type="CAUSAL_LM")
    try:
        model: Any = _hf_model(shape, device)
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[Timer()],
        )
        result["built"] = _memory(device)
        trainer.train()
    except Exception as e:
        if "out of memory" not in str(e).lower():
            raise
        result["error"] = f"out of memory after {len(per_step)} steps: {str(e).splitlines()[0]}"
        return result
    return _finish(result, args, marks, per_step)


def _finish(
    result: dict[str, Any], args: argparse.Namespace, marks: list[float], per_step: list[dict[str, float]]
) -> dict[str, Any]:
    timed = marks[args.warmup - 1 :] if args.warmup > 0 else marks
    seconds = timed[-1] - timed[0]
    result["tokens_per_s"] = (
        args.batch * args.seq * (len(timed) - 1) / seconds if seconds > 0 else float("nan")
    )
    result["step_s"] = [round(b - a, 4) for a, b in itertools.pairwise(marks)]
    timed_steps = sorted(b - a for a, b in itertools.pairwise(timed))
    # the median step: what a long run sees when an occasional slow step is rare
    result["median_step_tokens_per_s"] = (
        args.batch * args.seq / timed_steps[len(timed_steps) // 2] if timed_steps else float("nan")
    )
    result["step0_peak_gib"] = per_step[0]["peak_gib"]
    steady = per_step[args.warmup :] or per_step
    result["steady_peak_gib"] = max(s["peak_gib"] for s in steady)
    result["steady_reserved_gib"] = max(s["reserved_gib"] for s in steady)
    result["steady_allocated_gib"] = max(s["allocated_gib"] for s in steady)
    return result


def run_one(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    _cap(args, device)
    runners = {"d9d": run_d9d, "hf": run_hf, "trl": run_trl}
    result = runners[args.impl](args, device)
    if device.type == "cuda":  # cache flushes and retries mean the cap forced frees mid-step
        result["alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    print("RESULT " + json.dumps(result), flush=True)


def _child(args: argparse.Namespace, job: str, impl: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--job", job, "--impl", impl, "--device", args.device]
    command += ["--seq", str(args.seq), "--batch", str(args.batch), "--cap-gib", str(args.cap_gib)]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--quick"] * args.quick + ["--snapshot"] * args.snapshot
    command += ["--gc-every", str(args.gc_every)] if args.gc_every else []
    command += ["--no-recompute"] * args.no_recompute + (["--profile", args.profile] if args.profile else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("RESULT ")), flush=True)
    if not lines:
        return {"impl": impl, "job": job, "error": f"exit {done.returncode}: {done.stderr[-6000:]}"}
    return json.loads(lines[-1].removeprefix("RESULT "))


def run_all(args: argparse.Namespace) -> None:
    results: list[dict[str, Any]] = []
    for job in args.jobs:
        for _ in range(args.rounds):
            for impl in args.impls:  # alternating, one process each
                result = _child(args, job, impl)
                print(json.dumps(result), flush=True)
                results.append(result)
                if args.json:  # as each run ends: a call cut short keeps what it measured
                    with open(args.json, "a") as f:
                        f.write(json.dumps(result) + "\n")
    print(f"\ncap {args.cap_gib} GiB, seq {args.seq}, batch {args.batch}; median (min-max) of {args.rounds}")
    print(
        "| job | impl | tok/s | median-step tok/s | step-0 peak GiB | steady peak GiB | steady reserved GiB "
        "| d9d / this | median steps: d9d / this |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for job in args.jobs:
        rows = {impl: [r for r in results if r["job"] == job and r["impl"] == impl] for impl in args.impls}
        for impl, runs in rows.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                print(
                    f"| {job} | {impl} | {runs[0].get('error', 'no run')[:80] if runs else '-'} | | | | | | |"
                )
                continue
            ratio = median_ratio = "-"
            if impl != "d9d" and "d9d" in rows:
                pairs = list(zip([r for r in rows["d9d"] if "error" not in r], ok, strict=False))
                ratio = spread([a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs])
                median_ratio = spread(
                    [a["median_step_tokens_per_s"] / b["median_step_tokens_per_s"] for a, b in pairs]
                )
            print(
                f"| {job} | {impl} | {spread([r['tokens_per_s'] for r in ok], 0)} "
                f"| {spread([r['median_step_tokens_per_s'] for r in ok], 0)} "
                f"| {spread([r['step0_peak_gib'] for r in ok])} "
                f"| {spread([r['steady_peak_gib'] for r in ok])} "
                f"| {spread([r['steady_reserved_gib'] for r in ok])} | {ratio} | {median_ratio} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", nargs="+", choices=list(JOBS), default=["lora8b", "full1p7b"])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--job", choices=list(JOBS), help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--snapshot", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--profile", help="d9d only: write a Chrome trace of the first two timed steps here")
    parser.add_argument("--no-recompute", action="store_true", help="d9d only: no activation checkpointing")
    parser.add_argument("--gc-every", type=int, help="d9d only: automatic GC off, a collection every N steps")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.quick:
        args.seq = min(args.seq, 64)
    if args.job is not None:
        run_one(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
