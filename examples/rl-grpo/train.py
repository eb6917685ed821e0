"""d9d GRPO: a tiny Qwen3 learns single-digit addition from a reward a program checks.

Run:  uv run examples/rl-grpo/train.py examples/rl-grpo/config.yaml [--steps N] [--report out.json]

One iteration per step: the embedded engine generates (trainer asleep) -> rewards are scored ->
the trainer wakes and takes a GRPO step -> the new weights stream to the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from arithmetic import (
    EOS,
    PAD,
    all_prompts,
    arithmetic_prompts,
    arithmetic_reward,
    balanced_prompts,
    decode,
    greedy_accuracy,
    shaped_reward,
)
from pydantic import BaseModel, ConfigDict

from d9d.hf import DecoderCausalLM, HFModelProvider, PretrainedModelConfig, ScratchModelConfig
from d9d.hf.qwen3 import Qwen3DenseConfig
from d9d.loop import AutoLRSchedulerProvider, AutoOptimizerProvider, ProjectConfig, TrainingConfigurator
from d9d.rl import (
    ColocatedRollouts,
    EmbeddedRolloutEngine,
    GRPOLossConfig,
    GRPOTask,
    ReferenceConfig,
    ReferenceModel,
    SamplingParams,
    stream_weights,
)


class RLConfig(BaseModel):
    """The ``rl`` section: rollouts per step, sampling, the GRPO loss and its reference model.

    ``reference`` (None: no reference; ``loss.kl_coefficient`` must then be 0) keeps a frozen
    copy of the policy's starting point for the KL term; ``reference_model`` builds it from
    another checkpoint instead (None: the policy's own ``model``).
    """

    model_config = ConfigDict(extra="forbid")

    prompts_per_step: int
    sampling: SamplingParams
    reward: Literal["exact", "shaped"] = "exact"
    prompts: Literal["pairs", "balanced"] = "pairs"
    loss: GRPOLossConfig = GRPOLossConfig()
    reference: ReferenceConfig | None = None
    reference_model: PretrainedModelConfig | None = None


class GRPOProjectConfig(ProjectConfig):
    """The trainer's sections plus the model's config.json and the ``rl`` section."""

    model: Qwen3DenseConfig
    rl: RLConfig


@dataclass(kw_only=True, frozen=True)
class RunResult:
    """What a run measured: the mean reward of every step it ran, greedy accuracy before and after.

    ``steps`` names the step of each reward: a resumed run starts at its checkpoint's step.
    """

    steps: list[int]
    rewards: list[float]
    accuracy_before: float
    accuracy_after: float
    seconds: float


def evaluate(engine: EmbeddedRolloutEngine, *, show: int = 0) -> float:
    """Greedy accuracy of the engine's current weights over the whole table (55 prompts)."""
    prompts = all_prompts()
    samples = engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, stop_token_ids=(EOS,)))
    completions = [s.token_ids for s in samples]
    for index in range(0, len(prompts), len(prompts) // show if show else len(prompts) + 1):
        print(f"{decode(prompts[index])} {decode(completions[index])}", file=sys.stderr)
    return greedy_accuracy(prompts, completions)


def run(config: GRPOProjectConfig) -> RunResult:
    """Trains; returns the reward of every step and the greedy accuracy before and after."""
    started = time.perf_counter()
    device = torch.device(config.trainer.device or "cpu")
    torch.manual_seed(config.trainer.seed + 1)  # the engine's model is overwritten by the first stream
    engine = EmbeddedRolloutEngine(
        DecoderCausalLM(config.model, attention_backend="sdpa").to(device),
        seed=config.trainer.seed,
        pad_token_id=PAD,
    )
    provider = HFModelProvider(ScratchModelConfig(config=config.model, attention_backend="sdpa"))
    reference = None
    if config.rl.reference is not None:
        source = config.rl.reference_model
        reference = ReferenceModel(
            provider if source is None else HFModelProvider(source), config.rl.reference
        )
    rollouts = ColocatedRollouts(
        engine=engine,
        prompts=balanced_prompts if config.rl.prompts == "balanced" else arithmetic_prompts,
        reward=shaped_reward if config.rl.reward == "shaped" else arithmetic_reward,
        sampling=config.rl.sampling,
        prompts_per_step=config.rl.prompts_per_step,
        pad_token_id=PAD,
        seed=config.trainer.seed,  # with the step and rank, seeds every rollout: resume is exact
        reference=reference,  # its log-probs of every rollout, computed while the trainer sleeps
    )
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=lambda _: GRPOTask(config.rl.loss, reference=reference),
        data_provider=rollouts,
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    rollouts.attach(trainer)
    with trainer:
        stream_weights(trainer.model_stages[0], engine)  # the initial weights, to measure "before"
        before = evaluate(engine)
        trainer.train()
        engine.wake()
        stream_weights(trainer.model_stages[0], engine)  # the weights after the last step
        after = evaluate(engine, show=6)
        if trainer.dist_context.is_main_process:
            for record in rollouts.history[:: max(len(rollouts.history) // 10, 1)]:
                print(f"step {record.step:4d}  mean reward {record.mean_reward:.3f}", file=sys.stderr)
    seconds = time.perf_counter() - started
    print(
        f"greedy accuracy on all 55 prompts: {before:.3f} before, {after:.3f} after "
        f"({len(rollouts.history)} steps, {seconds:.0f} s)",
        file=sys.stderr,
    )
    return RunResult(
        steps=[r.step for r in rollouts.history],
        rewards=[r.mean_reward for r in rollouts.history],
        accuracy_before=before,
        accuracy_after=after,
        seconds=seconds,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="GRPO on single-digit addition with a tiny Qwen3")
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument(
        "--report", type=Path, default=None, help="write the steps run and their mean rewards as JSON"
    )
    args = parser.parse_args(argv)
    config = GRPOProjectConfig.from_yaml(args.config)
    if args.steps is not None:
        config = config.model_copy(
            update={"trainer": config.trainer.model_copy(update={"max_steps": args.steps})}
        )
    result = run(config)
    if args.report is not None:
        args.report.write_text(
            json.dumps(
                {
                    "steps": result.steps,
                    "rewards": result.rewards,
                    "accuracy_before": result.accuracy_before,
                    "accuracy_after": result.accuracy_after,
                    "seconds": result.seconds,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
