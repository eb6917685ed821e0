"""The rollout-engine contract: generate completions, take new weights, sleep and wake."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length"]
"""``stop``: a stop token was sampled (it ends the completion); ``length``: ``max_tokens`` reached."""


class SamplingParams(BaseModel):
    """How to sample completions.

    Attributes:
        max_tokens: Most tokens per completion (stop token included).
        temperature: Logits are divided by it before sampling; 0 is greedy.
        top_p: Sample from the smallest set of tokens whose probability reaches ``top_p``.
        top_k: Sample from the ``top_k`` most likely tokens; None: all.
        stop_token_ids: Sampling one of these ends the completion (the token is kept).
        samples_per_prompt: Completions per prompt (GRPO's group size), adjacent in the output.
        seed: Seeds this call's sampling; None draws from the engine's own generator (seeded at
            construction, so a run is reproducible either way).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=64, gt=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, gt=0)
    stop_token_ids: tuple[int, ...] = ()
    samples_per_prompt: int = Field(default=1, gt=0)
    seed: int | None = None


@dataclass(kw_only=True, frozen=True)
class Completion:
    """One sampled completion.

    Attributes:
        prompt_index: Index of its prompt in the ``generate`` call.
        token_ids: The sampled tokens, on the host.
        log_probs: ``(len(token_ids),)`` float32 log-probabilities of each sampled token under the
            model's own distribution (temperature 1, no top-p/top-k filtering): what the trainer's
            forward computes for the same tokens, so they serve as GRPO's old log-probs.
        finish_reason: Why sampling stopped.
    """

    prompt_index: int
    token_ids: tuple[int, ...]
    log_probs: torch.Tensor
    finish_reason: FinishReason


class WeightReceiver(Protocol):
    """Anything that takes named tensors (a rollout engine): what weight streaming sends to."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies the given tensors into the weights of the same names (a part of the model)."""
        ...


class RolloutEngine(WeightReceiver, Protocol):
    """Generates completions for RL; the embedded engine and external engines (vLLM, SGLang) fit it."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        """``len(prompts) * sampling.samples_per_prompt`` completions, grouped by prompt, in order."""
        ...

    def sleep(self) -> None:
        """Frees the accelerator memory the engine holds (weights and caches move to the host)."""
        ...

    def wake(self) -> None:
        """Undoes ``sleep``; the weights are bit-identical to before."""
        ...
