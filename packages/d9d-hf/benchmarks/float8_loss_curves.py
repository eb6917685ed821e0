"""bf16 against FP8 loss curves: the same d9d job, seed and data, trained twice.

The bf16 run is d9d's default precision (float32 master weights and AdamW state, bf16 compute);
the FP8 run adds the model config's ``float8`` section (``--float8 tensorwise|rowwise``; on the
MoE shape the experts' grouped GEMMs in FP8 too, unless ``--no-float8-experts``). Everything else
is equal: the shape, the initialization seed, the batches, AdamW with a linear warm-up and a
cosine decay. Each run is its own process (config -> TrainingConfigurator -> Trainer with
d9d-hf's provider, as ``train_throughput.py`` builds it) and reports the loss of every step
through the trainer's ``StepFinished`` event.

The data is synthetic but learnable: a fixed sparse Markov chain over a random subset of the
vocabulary (``--active-vocab`` tokens, each with ``--successors`` likely next tokens of falling
probability, and with probability ``--noise`` a uniform jump), every row drawn from its own
seeded generator, so both runs see the same batches. The loss falls from ln(vocab) towards the
chain's entropy, which the script prints as the floor.

    python float8_loss_curves.py                                   # Qwen3-0.6B widths, tensorwise
    python float8_loss_curves.py --model moe --float8 rowwise      # MoE shape, experts in FP8 too
    python float8_loss_curves.py --model moe --no-float8-experts   # MoE, dense layers only in FP8
    python float8_loss_curves.py --json curves.json                # also write both curves
    python float8_loss_curves.py --device cpu --quick              # a tiny smoke run on a CPU

Output: a row every 25 steps (the loss of each run and the relative gap
``(loss_fp8 - loss_bf16) / loss_bf16``), then the mean gap over the last 50 steps and the largest
gap (by magnitude) between the 20-step moving averages of the two curves after step 50.

On a CPU there is no bf16 compute (d9d keeps float32 parameters there) and no FP8 grouped GEMM: the
FP8 run converts the linear layers through torch's CPU ``_scaled_mm`` (``--emulate``: emulated in
high precision) and leaves the experts in float32; the script says so when it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import SHAPES, model_shape

RUNS = ("bf16", "fp8")
TABLE_EVERY = 25
LAST_STEPS = 50
"""The summary's mean relative gap is over this many last steps."""
MOVING_AVERAGE = 20
MOVING_AVERAGE_FROM = 50
"""The moving averages are compared from this step on (the first steps move too fast to compare)."""


class MarkovTokens:
    """A map-style dataset of rows of one fixed sparse Markov chain; row ``i`` is the same in every process.

    The chain's states are ``active`` token ids drawn at random from the vocabulary. Each state has
    ``successors`` next states drawn at random, taken with probabilities proportional to
    ``1, 1/2, 1/4, ...``; with probability ``noise`` the chain instead jumps to a uniformly drawn
    state. A row starts at a uniformly drawn state.
    """

    def __init__(
        self, *, rows: int, seq: int, vocab: int, active: int, successors: int, noise: float, seed: int
    ) -> None:
        self._rows, self._seq, self._active, self._noise, self._seed = rows, seq, active, noise, seed
        generator = torch.Generator().manual_seed(seed)
        self._tokens = torch.randperm(vocab, generator=generator)[:active]
        self._next: list[list[int]] = torch.randint(
            0, active, (active, successors), generator=generator
        ).tolist()
        weights = 0.5 ** torch.arange(successors, dtype=torch.float64)
        self._probs = (weights / weights.sum()).float()

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index: int) -> Any:
        from d9d.hf import TokenSample

        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + index + 1)
        steps = self._seq - 1
        choices = torch.multinomial(self._probs, steps, replacement=True, generator=generator).tolist()
        jumps = (torch.rand(steps, generator=generator) < self._noise).tolist()
        targets = torch.randint(0, self._active, (steps,), generator=generator).tolist()
        state = int(torch.randint(0, self._active, (1,), generator=generator))
        states = [state]
        for choice, jump, target in zip(choices, jumps, targets, strict=True):
            state = target if jump else self._next[state][choice]
            states.append(state)
        return TokenSample(input_ids=self._tokens[torch.tensor(states)])

    def entropy_nats(self) -> float:
        """The chain's entropy per token (the loss floor), ignoring repeated successors of a state."""
        p = [(1 - self._noise) * float(q) + self._noise / self._active for q in self._probs]
        rest = self._active - len(p)
        uniform = self._noise / self._active
        return -sum(q * math.log(q) for q in p) - (rest * uniform * math.log(uniform) if rest > 0 else 0.0)


def _dataset(args: argparse.Namespace, vocab: int) -> MarkovTokens:
    return MarkovTokens(
        rows=args.steps * args.batch,
        seq=args.seq,
        vocab=vocab,
        active=min(args.active_vocab, vocab // 2),
        successors=args.successors,
        noise=args.noise,
        seed=args.seed,
    )


def _float8_section(args: argparse.Namespace, shape: dict[str, Any]) -> dict[str, Any]:
    """The model config's ``float8`` section of the FP8 run."""
    section: dict[str, Any] = {"recipe": args.float8}
    if args.emulate:
        section["emulate"] = True
    if args.quick:
        section["min_features"] = 16  # the tiny shape's layers convert too
    if shape["model_type"] == "qwen3_moe" and args.float8_experts and args.device == "cuda":
        section["experts"] = True
    return section


def train_one(args: argparse.Namespace, run: str, out: Path) -> None:
    """Trains one run (``bf16`` or ``fp8``) in this process; writes its per-step figures to ``out``."""
    from d9d.hf import HFModelProvider, ScratchModelConfig, TokenBatch, causal_lm_task
    from d9d.loop import (
        AutoDataProvider,
        AutoLRSchedulerProvider,
        AutoOptimizerProvider,
        ProjectConfig,
        StepFinished,
        TrainingConfigurator,
    )

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    shape = model_shape(args.model, args.quick)
    config = ProjectConfig.model_validate(
        {
            "mesh": {"data_parallel_shard": 1},
            "trainer": {
                "max_steps": args.steps,
                "global_batch_size": args.batch,
                "microbatch_size": args.batch,
                "seed": args.seed,
                "logging": {"progress_bar": False},
                "device": device.type,
                "initialization": {"layout_invariant": False},
                "gradient_clipping": {"max_norm": 1.0},
            },
            "optimizer": {"name": "adamw", "lr": args.lr, "weight_decay": 0.1},
            "lr_scheduler": {
                "name": "piecewise",
                "warmup": {"steps": args.warmup},
                "phases": [{"kind": "cosine", "steps": args.steps - args.warmup, "end_factor": 0.1}],
            },
            "data": {"seed": args.seed},
        }
    )
    section = _float8_section(args, shape) if run == "fp8" else None
    model = ScratchModelConfig.model_validate(
        {
            "config": shape,
            "param_dtype": "bfloat16" if device.type == "cuda" else None,
            "compile": args.compile,
            **({} if section is None else {"float8": section}),
        }
    )
    dataset = _dataset(args, shape["vocab_size"])
    losses: list[float] = []
    grad_norms: list[float] = []
    lrs: list[float] = []
    times: list[float] = []

    def on_step(event: StepFinished) -> None:
        times.append(time.perf_counter())
        losses.append(float(event.metrics["loss"]))
        grad_norms.append(float(event.metrics.get("grad_norm", float("nan"))))
        lrs.append(float(event.metrics.get("lr", float("nan"))))
        if len(losses) % TABLE_EVERY == 0 or len(losses) in (1, args.steps):
            print(f"  {run} step {len(losses)}: loss {losses[-1]:.4f}", flush=True)

    started = time.perf_counter()
    with TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _ctx: dataset, collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure() as trainer:
        trainer.events.subscribe(StepFinished, on_step)
        float8_layers = sum(
            type(m).__name__ == "Float8Linear" for stage in trainer.model_stages for m in stage.modules()
        )
        trainer.train()
    seconds = time.perf_counter() - started
    record = {
        "run": run,
        "float8": section,
        "float8_linear_layers": float8_layers,
        "seconds": seconds,
        # after the first step (compilation, allocator warm-up); the data are drawn in between
        "tokens_per_s": (len(times) - 1) * args.batch * args.seq / (times[-1] - times[0])
        if len(times) > 1
        else float("nan"),
        "loss": losses,
        "grad_norm": grad_norms,
        "lr": lrs,
    }
    out.write_text(json.dumps(record))


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean of ``window`` values (fewer at the start)."""
    return [
        sum(values[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window))
        for i in range(len(values))
    ]


def summarize(bf16: list[float], fp8: list[float]) -> dict[str, Any]:
    """The relative gaps of the FP8 curve against the bf16 one (steps counted from 1).

    ``mean_rel_gap_last``: the mean of ``(fp8 - bf16) / bf16`` over the last ``LAST_STEPS`` steps;
    ``max_rel_gap_moving_average``: the largest by magnitude (sign kept) of the same gap between the
    two curves' trailing ``MOVING_AVERAGE``-step means, at steps after ``MOVING_AVERAGE_FROM``.
    Shorter runs (smoke runs) scale the three windows down to a quarter, a half and half of the run.
    """
    steps = len(bf16)
    last = min(LAST_STEPS, max(steps // 4, 1))
    window = min(MOVING_AVERAGE, max(steps // 4, 1))
    start = min(MOVING_AVERAGE_FROM, steps // 2)
    gaps = [(f - b) / b for b, f in zip(bf16, fp8, strict=True)]
    ma_b, ma_f = moving_average(bf16, window), moving_average(fp8, window)
    ma_gaps = [(f - b) / b for b, f in zip(ma_b[start:], ma_f[start:], strict=True)]
    worst = max(range(len(ma_gaps)), key=lambda i: abs(ma_gaps[i]))
    return {
        "last_steps": last,
        "mean_rel_gap_last": sum(gaps[-last:]) / last,
        "moving_average_window": window,
        "moving_average_after_step": start,
        "max_rel_gap_moving_average": ma_gaps[worst],
        "max_rel_gap_moving_average_step": start + worst + 1,
        "final_loss_bf16": bf16[-1],
        "final_loss_fp8": fp8[-1],
        "rel_gap_per_step": gaps,
    }


def _child(args: argparse.Namespace, run: str, out: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--run", run, "--curve-out", str(out)]
    for key, value in vars(args).items():
        if key in ("run", "curve_out", "json", "timeout"):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            command.append(f"{flag}={value}")
    print(f"{run}: {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, timeout=args.timeout, check=False)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{run}: the run failed (exit status {done.returncode})")
    return json.loads(out.read_text())


def run_both(args: argparse.Namespace) -> None:
    shape = model_shape(args.model, args.quick)
    dataset = _dataset(args, shape["vocab_size"])
    on_cpu = args.device != "cuda"
    print(
        f"{args.model} ({shape['model_type']}, {shape['num_hidden_layers']} layers, hidden "
        f"{shape['hidden_size']}{', quick' if args.quick else ''}), {args.device}, seq {args.seq}, "
        f"batch {args.batch}, {args.steps} steps, AdamW lr {args.lr:g} (warm-up {args.warmup}, "
        f"cosine to 0.1x), seed {args.seed}\n"
        f"data: Markov chain over {min(args.active_vocab, shape['vocab_size'] // 2)} of "
        f"{shape['vocab_size']} tokens, {args.successors} successors each, noise {args.noise:g}; "
        f"loss at start ~ln(vocab) = {math.log(shape['vocab_size']):.2f}, floor (chain entropy) "
        f"~{dataset.entropy_nats():.2f} nats",
        flush=True,
    )
    if on_cpu:
        print(
            "CPU: the 'bf16' run keeps float32 parameters and compute (d9d has no bf16 compute on CPU); "
            "the 'fp8' run converts the linear layers through torch's CPU _scaled_mm"
            + (" (emulated)" if args.emulate else "")
            + (
                "; the experts stay in float32 (the FP8 grouped GEMM needs a Hopper GPU)"
                if shape["model_type"] == "qwen3_moe" and args.float8_experts
                else ""
            ),
            flush=True,
        )
    with tempfile.TemporaryDirectory(prefix="d9d_float8_curves_") as scratch:
        records = {run: _child(args, run, Path(scratch) / f"{run}.json") for run in RUNS}
    bf16, fp8 = records["bf16"]["loss"], records["fp8"]["loss"]
    if len(bf16) != args.steps or len(fp8) != args.steps:
        raise SystemExit(f"expected {args.steps} losses per run, got bf16 {len(bf16)} and fp8 {len(fp8)}")
    summary = summarize(bf16, fp8)
    label = "fp32" if on_cpu else "bf16"
    print(
        f"\nFP8 run: float8 section {records['fp8']['float8']}, "
        f"{records['fp8']['float8_linear_layers']} linear layers converted"
    )
    for run in RUNS:
        print(
            f"{run}: {records[run]['seconds']:.0f} s, "
            f"{records[run]['tokens_per_s'] / 1e3:.1f}k tok/s after step 1"
        )
    print(f"\n| step | loss {label} | loss fp8 | rel gap |")
    print("|---:|---:|---:|---:|")
    every = TABLE_EVERY if args.steps >= 4 * TABLE_EVERY else max(1, args.steps // 6)
    rows = sorted({1, *range(every, args.steps + 1, every), args.steps})
    for step in rows:
        b, f = bf16[step - 1], fp8[step - 1]
        print(f"| {step} | {b:.4f} | {f:.4f} | {(f - b) / b:+.2%} |")
    print(
        f"\nmean rel gap (fp8 - {label}) / {label}, last {summary['last_steps']} steps: "
        f"{summary['mean_rel_gap_last']:+.3%}\n"
        f"max rel gap of the {summary['moving_average_window']}-step moving averages after step "
        f"{summary['moving_average_after_step']}: {summary['max_rel_gap_moving_average']:+.3%} "
        f"(step {summary['max_rel_gap_moving_average_step']})",
        flush=True,
    )
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("run", "curve_out", "json", "timeout")}
        Path(args.json).write_text(
            json.dumps(
                {
                    "settings": settings,
                    "shape": shape,
                    "entropy_floor_nats": dataset.entropy_nats(),
                    "summary": summary,
                    "runs": records,
                },
                indent=1,
            )
        )
        print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        choices=[name for name in ("dense", "moe") if name in SHAPES],
        default="dense",
        help="dense: Qwen3-0.6B; moe: Qwen3-30B-A3B widths, 6 layers (train_throughput.py's shapes)",
    )
    parser.add_argument("--float8", choices=["tensorwise", "rowwise"], default="tensorwise")
    parser.add_argument(
        "--float8-experts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="MoE shape: the experts' grouped GEMMs in FP8 (rowwise) too (GPU only)",
    )
    parser.add_argument(
        "--emulate",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="emulate the FP8 matmuls in high precision (float8.emulate)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the model config's compile: true, both runs",
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="rows per step")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=20, help="linear warm-up steps (then cosine to 0.1x)")
    parser.add_argument("--seed", type=int, default=0, help="initialization, data and sample order")
    parser.add_argument("--active-vocab", type=int, default=512, help="tokens the Markov chain visits")
    parser.add_argument("--successors", type=int, default=4, help="likely next tokens of each token")
    parser.add_argument("--noise", type=float, default=0.05, help="probability of a uniform jump")
    parser.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="tiny shape, 12 steps of 4 x 128 tokens: a smoke run",
    )
    parser.add_argument("--json", help="write both curves, the settings and the summary here")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--curve-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick and args.run is None:
        quick = {"steps": 12, "seq": 128, "batch": 4, "warmup": 2, "lr": 3e-3}
        for key, value in quick.items():
            if parser.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if (args.batch * args.seq) % 16 != 0:
        parser.error("FP8 matmuls need batch x seq divisible by 16")
    if args.run is not None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        train_one(args, args.run, Path(args.curve_out))
    else:
        run_both(args)


if __name__ == "__main__":
    main()
