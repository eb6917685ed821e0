"""The colocated RL loop as a d9d-loop batch source: each step's batch is a fresh, scored rollout."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from d9d.loop import DataProviderContext, Trainer
from d9d.rl._grpo_task import RolloutBatch
from d9d.rl._losses import group_advantages
from d9d.rl._reference_model import ReferenceModel
from d9d.rl._rollout_engine import Completion, RolloutEngine, SamplingParams
from d9d.rl._weight_streaming import DEFAULT_BATCH_BYTES, stream_weights
from d9d.state_mappers import StateMapper


class RewardFunction(Protocol):
    """Scores one completion of one prompt (token ids); a plain function fits."""

    def __call__(self, *, prompt: Sequence[int], completion: Sequence[int]) -> float:
        """The reward: higher is better."""
        ...


class PromptSource(Protocol):
    """Prompts for a step; a function of the step (and rank), so a resumed run gets the same ones."""

    def __call__(self, *, step: int, dp_rank: int, count: int) -> list[list[int]]:
        """``count`` prompts (token ids) for this rank at ``step``."""
        ...


@dataclass(kw_only=True, frozen=True)
class RolloutRecord:
    """What one iteration produced (for logging and tests).

    Attributes:
        step: The optimizer step the rollout feeds.
        mean_reward: Mean reward over this rank's completions.
        mean_length: Mean completion length in tokens.
    """

    step: int
    mean_reward: float
    mean_length: float


@dataclass(kw_only=True)
class ColocatedRollouts:
    """A ``DataProvider`` and ``BatchSource`` whose batches come from a colocated rollout engine.

    One iteration, inside ``next_batch`` (the trainer awake, after the previous optimizer step):
    the engine wakes -> the trainer's weights stream to it -> the trainer sleeps -> the engine
    generates ``prompts_per_step * sampling.samples_per_prompt`` completions -> the engine sleeps
    -> the rewards are scored, group-normalized into advantages -> (with a ``reference``) the
    reference model computes its log-probs of the completions, alone on the device -> the trainer
    wakes and trains on the batch (GRPO steps) -> the next iteration streams the new weights.

    ``attach(trainer)`` after ``TrainingConfigurator.configure()``: the batch source is built
    before the trainer exists; it also builds the ``reference`` beside the trainer's policy.
    Supports one pipeline stage per rank (the whole model, under any
    data/tensor parallelism): every rank streams and generates with its own engine.

    Random state: step ``s`` samples with the seed ``rollout_seed(seed, step=s, dp_rank=r)``
    (passed as ``SamplingParams.seed``, so the engine's own generator is not used) and asks the
    prompt source for step ``s``'s prompts. Rollouts are therefore a function of the step, the
    rank and the weights, never of what ran before in this process: a run resumed from a
    checkpoint draws exactly the prompts and samples the uninterrupted run drew.

    State (``state_dict``, saved in the trainer's checkpoint as its data position): the number of
    rollouts produced, which restores the step, and so the prompts and the sampling seed; weights
    are streamed again from the restored trainer at the next rollout. ``history`` is this
    process's log and is not restored.

    Raises:
        ValueError: If ``sampling.seed`` is set (``seed`` seeds the rollouts).

    Attributes:
        engine: The rollout engine of this rank.
        prompts: The prompt source.
        reward: The reward function.
        sampling: How to sample (``samples_per_prompt`` is the group size); its ``seed`` must be
            unset: each step's seed is derived from ``seed``.
        prompts_per_step: Prompts per rank per step.
        pad_token_id: Fills padding in the training batch.
        mapper: Maps the trainer's state names to the engine's (None: identity).
        batch_bytes: Weight-streaming batch size.
        seed: The run's rollout seed, from which every step's sampling seed is derived.
        reference: The frozen reference model whose log-probs each batch carries
            (``RolloutBatch.ref_log_probs``, for GRPO's KL term); None computes none.
        history: One record per rollout (this rank's view).
    """

    engine: RolloutEngine
    prompts: PromptSource
    reward: RewardFunction
    sampling: SamplingParams
    prompts_per_step: int
    pad_token_id: int = 0
    mapper: StateMapper | None = None
    batch_bytes: int = DEFAULT_BATCH_BYTES
    seed: int = 0
    reference: ReferenceModel | None = None
    history: list[RolloutRecord] = field(default_factory=list[RolloutRecord])
    _trainer: Trainer | None = None
    _dp_rank: int = 0
    _produced: int = 0

    def __post_init__(self) -> None:
        if self.sampling.seed is not None:
            raise ValueError(
                f"sampling.seed={self.sampling.seed}: ColocatedRollouts seeds every step itself from "
                f"ColocatedRollouts.seed={self.seed}, the step and the rank (so a resumed run repeats "
                "the uninterrupted one); leave sampling.seed unset and set ColocatedRollouts.seed"
            )

    def build(self, context: DataProviderContext) -> ColocatedRollouts:
        """The ``DataProvider`` side: checks the batch size and returns this source.

        Raises:
            ValueError: If the rank's batch is not ``prompts_per_step * samples_per_prompt`` samples.
        """
        expected = self.prompts_per_step * self.sampling.samples_per_prompt
        if context.local_batch_size != expected:
            raise ValueError(
                f"each rank's batch is {context.local_batch_size} samples (global_batch_size / dp), but "
                f"prompts_per_step={self.prompts_per_step} x samples_per_prompt="
                f"{self.sampling.samples_per_prompt} = {expected}"
            )
        self._dp_rank = context.dp_rank
        return self

    def attach(self, trainer: Trainer) -> None:
        """Binds the trainer whose weights stream to the engine and which sleeps during rollouts.

        Builds the ``reference`` (``ReferenceModel.attach``) from the trainer's initial weights.
        """
        if len(trainer.model_stages) != 1:
            raise ValueError(
                f"colocated rollouts need one model stage per rank, got {len(trainer.model_stages)}"
            )
        if self.reference is not None:
            self.reference.attach(trainer)
        self._trainer = trainer

    @property
    def steps_per_epoch(self) -> int:
        """Rollouts never run out; runs are sized by ``trainer.max_steps``."""
        return 2**31

    def state_dict(self) -> dict[str, Any]:
        """The number of rollouts produced: the next rollout's step, prompts and sampling seed."""
        return {"produced": self._produced}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues after ``state["produced"]`` rollouts, with that step's prompts and seed."""
        self._produced = int(state["produced"])

    def next_batch(self) -> RolloutBatch:
        """Runs one rollout iteration (see the class docstring) and returns the scored batch."""
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError("call ColocatedRollouts.attach(trainer) after configure() and before train()")
        step = self._produced
        prompts = self.prompts(step=step, dp_rank=self._dp_rank, count=self.prompts_per_step)
        self.engine.wake()
        stream_weights(trainer.model_stages[0], self.engine, mapper=self.mapper, batch_bytes=self.batch_bytes)
        trainer.sleep()
        sampling = self.sampling.model_copy(
            update={"seed": rollout_seed(self.seed, step=step, dp_rank=self._dp_rank)}
        )
        completions = self.engine.generate(prompts, sampling)
        self.engine.sleep()
        try:
            return self._scored_batch(step, prompts, completions)
        finally:
            trainer.wake()

    def _scored_batch(
        self, step: int, prompts: list[list[int]], completions: list[Completion]
    ) -> RolloutBatch:
        """Rewards, advantages and (with a reference) reference log-probs; the trainer asleep."""
        rewards = torch.tensor(
            [self.reward(prompt=prompts[c.prompt_index], completion=c.token_ids) for c in completions],
            dtype=torch.float32,
        )
        advantages = group_advantages(rewards, self.sampling.samples_per_prompt)
        self.history.append(
            RolloutRecord(
                step=step,
                mean_reward=float(rewards.mean()),
                mean_length=sum(len(c.token_ids) for c in completions) / max(len(completions), 1),
            )
        )
        batch = RolloutBatch.from_completions(
            prompts, completions, advantages, pad_token_id=self.pad_token_id
        )
        if self.reference is not None:
            # the trainer and the engine asleep: the reference has the device to itself
            batch.ref_log_probs = self.reference.log_probs(batch.decoder_inputs())
        self._produced += 1
        return batch


def rollout_seed(seed: int, *, step: int, dp_rank: int) -> int:
    """The sampling seed of one rollout: a hash of the run's seed, the step and the rank.

    Hashing (rather than ``seed + step``) keeps the streams of different steps, ranks and runs
    apart, and apart from the trainer's own seeds (``derived_seed`` of the same run seed).

    Args:
        seed: The run's rollout seed.
        step: The optimizer step the rollout feeds.
        dp_rank: The data-parallel rank that generates it.

    Returns:
        A non-negative 63-bit integer (a valid ``torch.Generator`` seed).
    """
    digest = hashlib.blake2b(f"d9d.rl rollout {seed} {step} {dp_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
