"""Host time per decoder layer of a training step: d9d's job against transformers' model, same run.

At tiny widths (hidden 64, seq 16, batch 2) a layer's kernels take microseconds, so a step is
almost all host work: Python in the modules, autograd, hooks, the optimizer and the loop. Each
implementation trains a Qwen3-shaped model at two depths (``--layers 4 28``); the difference
between the two, divided by the layers added, is the host time one decoder layer adds to a step
(forward, backward and its share of the optimizer), free of the fixed costs (data, loss, logging).
Printed per implementation: that slope in wall time and in main-thread CPU time, each the median
over ``--repeats`` alternating rounds with its range, each implementation and depth in its own
process.

Implementations: ``d9d`` (config -> TrainingConfigurator -> Trainer with d9d-hf's provider, as a
user runs it), ``d9d_compile`` (the same with ``compile: true``) and ``hf`` (transformers'
Qwen3ForCausalLM in a plain loop: forward, loss, backward, clipping, AdamW). On a GPU the d9d rows
compute in bf16 with float32 master weights; transformers' row runs in bf16.

Run:  uv run python packages/d9d-hf/benchmarks/host_time_per_layer.py [--device cpu] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _stats import spread

SHAPE: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
}
SEQ, BATCH = 16, 2
IMPLEMENTATIONS = ("d9d", "d9d_compile", "hf")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _RandomRows:
    def __init__(self, rows: int) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index: int) -> Any:
        from d9d.hf import TokenSample

        ids = torch.randint(0, SHAPE["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(index))
        return TokenSample(input_ids=ids, labels=ids.clone())


def _d9d_steps(layers: int, steps: int, device: torch.device, compiled: bool) -> list[tuple[float, float]]:
    """(wall, main-thread CPU) clock at the end of every step of the d9d job."""
    from d9d.hf import HFModelProvider, ScratchModelConfig, TokenBatch, causal_lm_task
    from d9d.loop import (
        AutoDataProvider,
        AutoLRSchedulerProvider,
        AutoOptimizerProvider,
        ProjectConfig,
        StepFinished,
        TrainingConfigurator,
    )

    config = ProjectConfig.model_validate(
        {
            "trainer": {
                "max_steps": steps,
                "global_batch_size": BATCH,
                "microbatch_size": BATCH,
                "logging": {"progress_bar": False},
                "device": device.type,
                "initialization": {"layout_invariant": False},
                "gradient_clipping": {"max_norm": 1.0},
            },
            "optimizer": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.0},
        }
    )
    model = ScratchModelConfig.model_validate(
        {
            "config": {**SHAPE, "num_hidden_layers": layers},
            "param_dtype": "bfloat16" if device.type == "cuda" else None,
            "compile": compiled,
            "attention_backend": "sdpa",
        }
    )
    clocks: list[tuple[float, float]] = []

    def on_step(_event: StepFinished) -> None:
        clocks.append((time.perf_counter(), time.thread_time()))

    with TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _ctx: _RandomRows(steps * BATCH),
            collator=TokenBatch.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure() as trainer:
        trainer.events.subscribe(StepFinished, on_step)
        trainer.train()
        _sync(device)
    return clocks


def _hf_steps(layers: int, steps: int, device: torch.device) -> list[tuple[float, float]]:
    """(wall, main-thread CPU) clock at the end of every step of transformers' model in a plain loop."""
    import transformers

    fields = {k: v for k, v in SHAPE.items() if k != "model_type"}
    config = transformers.Qwen3Config(**fields, num_hidden_layers=layers, attn_implementation="sdpa")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model: Any = transformers.Qwen3ForCausalLM(config).to(device=device, dtype=dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=device.type == "cuda")
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    clocks: list[tuple[float, float]] = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss)  # the loop reads the loss every step, as d9d's does
        clocks.append((time.perf_counter(), time.thread_time()))
    return clocks


def run_one(
    implementation: str, layers: int, steps: int, warmup: int, device: torch.device
) -> dict[str, float]:
    """Median step time (wall and main-thread CPU, seconds) after ``warmup`` steps."""
    torch.manual_seed(0)
    if implementation == "hf":
        clocks = _hf_steps(layers, warmup + steps, device)
    else:
        clocks = _d9d_steps(layers, warmup + steps, device, compiled=implementation == "d9d_compile")
    timed = clocks[warmup - 1 :]
    walls = [b[0] - a[0] for a, b in itertools.pairwise(timed)]
    cpus = [b[1] - a[1] for a, b in itertools.pairwise(timed)]
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, nargs=2, default=[4, 28], metavar=("FEW", "MANY"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument("--one", nargs=2, metavar=("IMPL", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.one is not None:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args.steps, args.warmup, device)), flush=True)
        return
    few, many = args.layers
    slopes: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in args.only}
    steps: dict[str, list[float]] = {name: [] for name in args.only}
    for round_index in range(args.repeats):
        for name in args.only:
            result: dict[int, dict[str, float]] = {}
            for layers in (few, many):
                command = [sys.executable, str(Path(__file__)), "--one", name, str(layers)]
                command += [f"--device={args.device}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"{name} at {layers} layers failed:\n{done.stderr[-3000:]}")
                result[layers] = json.loads(done.stdout.strip().splitlines()[-1])
            for clock in ("wall", "cpu"):
                slopes[name][clock].append(1e6 * (result[many][clock] - result[few][clock]) / (many - few))
            steps[name].append(1e3 * result[many]["wall"])
            print(
                f"round {round_index + 1}: {name}: {slopes[name]['wall'][-1]:.0f} us per layer "
                f"(CPU {slopes[name]['cpu'][-1]:.0f} us), step at {many} layers {steps[name][-1]:.1f} ms",
                flush=True,
            )
    print(
        f"\nhost time per decoder layer and step, Qwen3 shape at hidden {SHAPE['hidden_size']}, seq {SEQ}, "
        f"batch {BATCH}, {few} vs {many} layers, {args.device}; median (min-max) of {args.repeats} round(s)"
    )
    print(
        "| implementation | us per layer (wall) | us per layer (main-thread CPU) | step at "
        f"{many} layers, ms |"
    )
    print("|---|---|---|---|")
    for name in args.only:
        wall, cpu = slopes[name]["wall"], slopes[name]["cpu"]
        print(f"| {name} | {spread(wall, 0)} | {spread(cpu, 0)} | {statistics.median(steps[name]):.1f} |")


if __name__ == "__main__":
    main()
