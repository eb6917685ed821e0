"""Soak test of kill -9 in a colocated GRPO run: does every resume end bit-exact with nothing lost?

Each trial trains a tiny Qwen3 with GRPO on 2 CPU ranks (``data_parallel_shard: 2``, gloo,
``d9d.mesh.testing``): rollouts from the embedded engine, rewards from a rule, a checkpoint after
every step. It kills every rank with SIGKILL at a random point (between steps, inside a
checkpoint's save, or inside a rollout, between the sampling and the scoring), then resumes the
run to the end and compares it with an uninterrupted reference run:

- bit-exact: the mean reward of every resumed step's rollouts, the losses and the final weights
  equal the reference's (each rank samples its own rollouts, so both ranks' random state must
  come back, not rank 0's);
- nothing lost: it resumed from the newest complete checkpoint.

Run:  uv run packages/d9d-rl/benchmarks/soak_rl.py [--trials 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from d9d.hf import DecoderCausalLM, HFModelProvider, ScratchModelConfig
from d9d.hf.qwen3 import Qwen3DenseConfig
from d9d.loop import (
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    EventBus,
    ForwardBackwardFinished,
    ProjectConfig,
    StepFinished,
    TrainingConfigurator,
)
from d9d.mesh.testing import DistributedTestError, run_distributed
from d9d.rl import ColocatedRollouts, EmbeddedRolloutEngine, GRPOTask, SamplingParams

STEPS = 8
WORLD = 2
VOCAB = 48
KILLS = ("between-steps", "inside-save", "inside-rollout")
SAMPLING = SamplingParams(samples_per_prompt=4, max_tokens=3, temperature=1.0)


def _model_config() -> Qwen3DenseConfig:
    return Qwen3DenseConfig.model_validate(
        {
            "model_type": "qwen3",
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
        }
    )


def _prompts(*, step: int, dp_rank: int, count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    return [[int(t) for t in torch.randint(2, VOCAB, (3,), generator=generator)] for _ in range(count)]


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(kw_only=True)
class _Reward:
    """1 for a first token up to VOCAB/2 above the prompt's last; SIGKILLs at a chosen call."""

    kill_call: int | None
    calls: int = 0

    def __call__(self, *, prompt: Sequence[int], completion: Sequence[int]) -> float:
        if self.calls == self.kill_call:
            _kill_self()
        self.calls += 1
        return float(len(completion) > 0 and (completion[0] - prompt[-1]) % VOCAB < VOCAB // 2)


def _train(directory: str | None, kill: str | None, kill_step: int) -> dict[str, Any]:
    """One rank of a run; with ``kill`` it SIGKILLs itself at ``kill_step``."""
    logging.getLogger("d9d").setLevel(logging.ERROR)
    trainer_config: dict[str, Any] = {
        "max_steps": STEPS,
        "global_batch_size": 8 * WORLD,
        "microbatch_size": 4,
        "seed": 3,
        "device": "cpu",
        "logging": {"progress_bar": False},
    }
    if directory is not None:
        trainer_config["checkpoint"] = {"directory": directory, "every_steps": 1, "keep_last": 2}
    config = ProjectConfig.model_validate(
        {
            "mesh": {"data_parallel_shard": WORLD},
            "trainer": trainer_config,
            "optimizer": {"name": "adamw", "lr": 0.05, "weight_decay": 0.0},
        }
    )
    events = EventBus()
    losses: dict[int, float] = {}
    events.subscribe(ForwardBackwardFinished, lambda e: losses.__setitem__(e.step, e.loss))
    per_step = 2 * SAMPLING.samples_per_prompt  # reward calls per step and rank
    kill_call = kill_step * per_step + per_step // 2 if kill == "inside-rollout" else None
    if kill == "between-steps":
        events.subscribe(StepFinished, lambda e: _kill_self() if e.step == kill_step else None)
    elif kill == "inside-save" and directory is not None:
        partial = Path(directory) / f"step_{kill_step:09d}.partial"

        def watch() -> None:
            while True:
                if partial.is_dir() and any(partial.iterdir()):
                    _kill_self()
                time.sleep(0.0005)

        threading.Thread(target=watch, daemon=True).start()
    torch.manual_seed(99)  # the engine's weights are overwritten by the first stream
    engine = EmbeddedRolloutEngine(DecoderCausalLM(_model_config(), attention_backend="eager"), seed=5)
    reward = _Reward(kill_call=kill_call)
    rollouts = ColocatedRollouts(
        engine=engine, prompts=_prompts, reward=reward, sampling=SAMPLING, prompts_per_step=2, seed=7
    )
    provider = HFModelProvider(ScratchModelConfig(config=_model_config(), attention_backend="eager"))
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=lambda _: GRPOTask(),
        data_provider=rollouts,
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        events=events,
    ).configure()
    rollouts.attach(trainer)
    with trainer:
        trainer.train()
        weights = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in trainer.model_stages[0].state_dict().items()
        }
    rewards = {record.step: record.mean_reward for record in rollouts.history}
    return {"losses": losses, "rewards": rewards, "weights": weights, "start": min(losses, default=STEPS)}


def _complete(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.startswith("step_") and "." not in p.name)


@dataclass(kw_only=True)
class Trial:
    kill: str
    kill_step: int
    expected_start: int
    start: int = -1
    bit_exact: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.bit_exact and self.start == self.expected_start


def _same(resumed: list[dict[str, Any]], reference: list[dict[str, Any]], start: int) -> bool:
    for got, expected in zip(resumed, reference, strict=True):
        if got["losses"] != {s: v for s, v in expected["losses"].items() if s >= start}:
            return False
        if got["rewards"] != {s: v for s, v in expected["rewards"].items() if s >= start}:
            return False
        if not all(torch.equal(got["weights"][k], v) for k, v in expected["weights"].items()):
            return False
    return True


def _trial(root: Path, index: int, rng: random.Random, reference: list[dict[str, Any]]) -> Trial:
    directory = root / f"trial_{index:03d}"
    kill = rng.choice(KILLS)
    kill_step = rng.randrange(2, STEPS - 1)
    try:
        run_distributed(_train, str(directory), kill, kill_step, world_size=WORLD, timeout_s=600)
        raise RuntimeError("the run was not killed")
    except DistributedTestError as e:
        if "-9" not in str(e):
            raise
    complete = _complete(directory)
    # step_N holds the state after N steps: the run continues at step N
    expected = int(complete[-1].name.split("_")[1]) if complete else 0
    trial = Trial(kill=kill, kill_step=kill_step, expected_start=expected)
    try:
        resumed = run_distributed(_train, str(directory), None, 0, world_size=WORLD, timeout_s=600)
    except DistributedTestError as e:
        trial.error = str(e).splitlines()[-1][:200]
        return trial
    trial.start = resumed[0]["start"]
    trial.bit_exact = _same(resumed, reference, trial.start)
    return trial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="kill points (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        reference = run_distributed(_train, None, None, 0, world_size=WORLD, timeout_s=600)
        trials: list[Trial] = []
        for index in range(args.trials):
            trial = _trial(Path(tmp), index, rng, reference)
            trials.append(trial)
            verdict = "ok" if trial.ok else f"FAILED {trial.error}"
            print(
                f"trial {index:2d}: kill {trial.kill} at step {trial.kill_step}: resumed at {trial.start} "
                f"(expected {trial.expected_start}), bit-exact {trial.bit_exact}: {verdict}",
                flush=True,
            )
    good = sum(t.ok for t in trials)
    print(f"{good} of {len(trials)} GRPO resumes ended bit-exact with nothing lost")


if __name__ == "__main__":
    main()
