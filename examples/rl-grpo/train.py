"""d9d GRPO: a tiny Qwen3 learns single-digit addition from a reward a program checks.

Run:  uv run examples/rl-grpo/train.py examples/rl-grpo/config.yaml [--steps N] [--report out.json]

One iteration per step: the embedded engine generates (trainer asleep) -> rewards are scored ->
the trainer wakes and takes a GRPO step -> the new weights stream to the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from arithmetic import PAD, arithmetic_prompts, arithmetic_reward, decode
from pydantic import BaseModel, ConfigDict

from d9d.hf import ScratchModelConfig
from d9d.hf.qwen3 import Qwen3CausalLM, Qwen3DenseConfig, Qwen3ModelProvider
from d9d.loop import AutoLRSchedulerProvider, AutoOptimizerProvider, ProjectConfig, TrainingConfigurator
from d9d.rl import ColocatedRollouts, EmbeddedRolloutEngine, GRPOLossConfig, GRPOTask, SamplingParams


class RLConfig(BaseModel):
    """The ``rl`` section: rollouts per step, sampling and the GRPO loss."""

    model_config = ConfigDict(extra="forbid")

    prompts_per_step: int
    sampling: SamplingParams
    loss: GRPOLossConfig = GRPOLossConfig()


class GRPOProjectConfig(ProjectConfig):
    """The trainer's sections plus the model's config.json and the ``rl`` section."""

    model: Qwen3DenseConfig
    rl: RLConfig


def run(config: GRPOProjectConfig) -> ColocatedRollouts:
    """Trains; returns the rollout source (its ``history`` holds the mean reward of every step)."""
    device = torch.device(config.trainer.device or "cpu")
    torch.manual_seed(config.trainer.seed + 1)  # the engine's model is overwritten by the first stream
    engine = EmbeddedRolloutEngine(
        Qwen3CausalLM(config.model, attention_backend="sdpa").to(device),
        seed=config.trainer.seed,
        pad_token_id=PAD,
    )
    rollouts = ColocatedRollouts(
        engine=engine,
        prompts=arithmetic_prompts,
        reward=arithmetic_reward,
        sampling=config.rl.sampling,
        prompts_per_step=config.rl.prompts_per_step,
        pad_token_id=PAD,
    )
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=Qwen3ModelProvider(ScratchModelConfig(config=config.model, attention_backend="sdpa")),
        task_provider=lambda _: GRPOTask(config.rl.loss),
        data_provider=rollouts,
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    rollouts.attach(trainer)
    with trainer:
        trainer.train()
        if trainer.dist_context.is_main_process:
            for record in rollouts.history[:: max(len(rollouts.history) // 10, 1)]:
                print(f"step {record.step:4d}  mean reward {record.mean_reward:.3f}", file=sys.stderr)
            engine.wake()
            samples = engine.generate(
                arithmetic_prompts(step=10**6, dp_rank=0, count=6),
                SamplingParams(max_tokens=2, temperature=0.0, stop_token_ids=(1,)),
            )
            prompts = arithmetic_prompts(step=10**6, dp_rank=0, count=6)
            for prompt, sample in zip(prompts, samples, strict=True):
                print(f"{decode(prompt)} {decode(sample.token_ids)}", file=sys.stderr)
    return rollouts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="GRPO on single-digit addition with a tiny Qwen3")
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument("--report", type=Path, default=None, help="write the mean reward per step as JSON")
    args = parser.parse_args(argv)
    config = GRPOProjectConfig.from_yaml(args.config)
    if args.steps is not None:
        config = config.model_copy(
            update={"trainer": config.trainer.model_copy(update={"max_steps": args.steps})}
        )
    rollouts = run(config)
    if args.report is not None:
        args.report.write_text(json.dumps([r.mean_reward for r in rollouts.history]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
