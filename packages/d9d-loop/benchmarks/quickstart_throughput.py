"""Step throughput of the quickstart job under d9d vs a hand-written PyTorch loop, same run.

Both train the same MLP on the same data for the same steps: seeded sample order, collation,
4 microbatches of gradient accumulation, AdamW (foreach), gradient clipping, a warm-up + cosine
LambdaLR. d9d's time covers `trainer.train()`; the configure step (process group, model build) is
excluded, as is the hand-written loop's setup.

Run:  uv run packages/d9d-loop/benchmarks/quickstart_throughput.py [--steps 300] [--hidden 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ProjectConfig,
    TrainingConfigurator,
)

REPO = Path(__file__).resolve().parents[3]


def load_quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart", REPO / "examples" / "quickstart" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config(steps: int, batch: int, micro: int, device: str) -> ProjectConfig:
    return ProjectConfig.model_validate(
        {
            "trainer": {
                "max_steps": steps,
                "global_batch_size": batch,
                "microbatch_size": micro,
                "logging": {"progress_bar": False},
                "device": device,
            },
            "optimizer": {"name": "adamw", "lr": 0.003, "weight_decay": 0.0},
            "lr_scheduler": {
                "name": "piecewise",
                "warmup": {"steps": 20},
                "phases": [{"kind": "cosine", "fraction": 1.0}],
            },
        }
    )


def run_d9d(qs: ModuleType, cfg: ProjectConfig, hidden: int, samples: int) -> float:
    class Provider(qs.MLPProvider):  # type: ignore[name-defined, misc]
        def initialize_model_stage(self, context):  # type: ignore[no-untyped-def]
            model = qs.MLP(num_features=16, hidden_size=hidden)
            return qs.InitializeModelStageResult(
                model=model, state_mapper=qs.identity_mapper_from_module(model)
            )

    trainer = TrainingConfigurator(
        mesh=cfg.mesh,
        parameters=cfg.trainer,
        model_provider=Provider(),
        task_provider=lambda ctx: qs.RegressionTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda dist_context: qs.RegressionDataset(samples, 16),
            collator=qs.RegressionDataset.collate,
            config=cfg.data,
        ),
        optimizer_provider=AutoOptimizerProvider(cfg.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(cfg.lr_scheduler),
    ).configure()
    start = time.perf_counter()
    trainer.train()
    if trainer.dist_context.device_type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    trainer.close()  # the trainer owns the context it built: this releases it too
    return elapsed


def run_hand_written(qs: ModuleType, cfg: ProjectConfig, hidden: int, samples: int, device: str) -> float:
    dev = torch.device(device)
    torch.manual_seed(0)
    model = qs.MLP(num_features=16, hidden_size=hidden).to(dev)
    data = qs.RegressionDataset(samples, 16)
    optimizer_kwargs = {"fused": True} if dev.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003, weight_decay=0.0, **optimizer_kwargs)
    steps, batch, micro = (
        cfg.trainer.max_steps or 0,
        cfg.trainer.global_batch_size,
        cfg.trainer.microbatch_size,
    )

    def factor(step: int) -> float:
        if step < 20:
            return step / 20
        t = min((step - 20) / max(steps - 20, 1), 1.0)
        return 0.5 * (1 + math.cos(math.pi * t))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(0)).tolist()
    per_epoch = samples // batch
    start = time.perf_counter()
    for step in range(steps):
        begin = (step % per_epoch) * batch
        sample_batch = qs.RegressionDataset.collate([data[i] for i in order[begin : begin + batch]])
        x, y = sample_batch.x.to(dev), sample_batch.y.to(dev)
        for m in range(batch // micro):
            xs, ys = x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]
            loss = F.mse_loss(model(qs.RegressionInput(x=xs), None), ys)
            (loss / (batch // micro)).backward()
        loss_value = loss.item()
        del loss_value
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro", type=int, default=64)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    qs = load_quickstart()
    cfg = config(args.steps, args.batch, args.micro, args.device)
    ratios, hand_rates, d9d_rates = [], [], []
    # Pairs of runs in alternating order; the median of the per-pair ratios is robust to a
    # shared machine's slow drifts, which a best-of-N over separate runs is not.
    for pair in range(args.repeats):
        if pair % 2 == 0:
            hand = run_hand_written(qs, cfg, args.hidden, args.samples, args.device)
            ours = run_d9d(qs, cfg, args.hidden, args.samples)
        else:
            ours = run_d9d(qs, cfg, args.hidden, args.samples)
            hand = run_hand_written(qs, cfg, args.hidden, args.samples, args.device)
        ratios.append(hand / ours)
        hand_rates.append(args.steps / hand)
        d9d_rates.append(args.steps / ours)
    print(
        f"device={args.device} hidden={args.hidden} steps={args.steps} batch={args.batch} micro={args.micro}"
    )
    print(f"hand-written loop: {statistics.median(hand_rates):8.1f} steps/s (median of {args.repeats})")
    print(f"d9d Trainer:       {statistics.median(d9d_rates):8.1f} steps/s (median of {args.repeats})")
    print(
        f"d9d / hand-written throughput ratio: {statistics.median(ratios):.3f} "
        f"(median of {args.repeats} alternating pairs; min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
