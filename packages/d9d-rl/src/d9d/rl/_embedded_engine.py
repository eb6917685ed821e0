"""A rollout engine inside the trainer's process, on a d9d-hf causal LM of any family."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from d9d.hf import DecoderCausalLM
from d9d.loop import TensorOffloader
from d9d.rl._kv_cache import KVCache, forward_with_cache
from d9d.rl._rollout_engine import Completion, FinishReason, SamplingParams
from d9d.rl._sampling import sample_next


class EmbeddedRolloutEngine:
    """Batched sampling with a KV cache from a whole (unsharded) ``DecoderCausalLM``; a ``RolloutEngine``.

    The engine owns ``model`` (its own copy of the policy, e.g. built from the same config and fed
    by ``stream_weights``). All prompts and samples of a call run as one batch, left-padded, so
    each row's positions start at 0 as in training. Log-probabilities are those of the model's own
    distribution (temperature 1, no filtering), equal to the trainer's forward on the same tokens.

    State: the weights (``update_weights`` copies into them) and a seeded generator that every
    unseeded ``generate`` call advances; ``sleep`` moves the weights to the host.

    Args:
        model: The whole model (first and last pipeline stage), on the device to generate on.
        seed: Seeds the engine's generator.
        pad_token_id: Fills padding slots (never attended to).
    """

    def __init__(self, model: DecoderCausalLM, *, seed: int = 0, pad_token_id: int = 0) -> None:
        model.require_whole_model("EmbeddedRolloutEngine")
        self._model = model.eval().requires_grad_(False)
        self._device = next(model.parameters()).device
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._pad = pad_token_id
        self._weights = model.state_dict()
        self._offloader = TensorOffloader(self._device)

    @property
    def model(self) -> DecoderCausalLM:
        """The engine's model (read it, e.g. to compare weights; do not train it)."""
        return self._model

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies each named tensor into the engine's weight of that name (cast to its dtype).

        Raises:
            RuntimeError: If the engine is asleep.
            KeyError: If a name is not one of the model's state-dict names.
            ValueError: If a shape differs.
        """
        if self._offloader.is_offloaded:
            raise RuntimeError("the engine is asleep; wake() it before update_weights")
        for name, tensor in weights:
            target = self._weights.get(name)
            if target is None:
                raise KeyError(f"the engine's model has no weight {name!r}")
            if target.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r}: the engine has shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
                )
            target.copy_(tensor)

    def sleep(self) -> None:
        """Moves the weights to the host (pinned on CUDA) and frees the allocator's cache."""
        if not self._offloader.is_offloaded:
            self._offloader.offload([*self._model.parameters(), *self._model.buffers()])

    def wake(self) -> None:
        """Brings the weights back, bit-exact."""
        if self._offloader.is_offloaded:
            self._offloader.restore()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        """Samples ``sampling.samples_per_prompt`` completions per prompt (adjacent, in prompt order).

        Raises:
            RuntimeError: If the engine is asleep.
            ValueError: If a prompt is empty.
        """
        if self._offloader.is_offloaded:
            raise RuntimeError("the engine is asleep; wake() it before generate")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        group = sampling.samples_per_prompt
        rows = [list(prompt) for prompt in prompts for _ in range(group)]
        if not rows:
            return []
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(sampling.seed)
        width = max(len(row) for row in rows)
        cache = KVCache.empty(
            self._model, rows=len(rows), capacity=width + sampling.max_tokens, device=self._device
        )
        prompt_ids = torch.full((len(rows), width), self._pad, dtype=torch.int64)
        for index, row in enumerate(rows):
            prompt_ids[index, width - len(row) :] = torch.tensor(row)
            cache.valid[index, width - len(row) : width] = True
        cache.positions[:, :width] = (cache.valid[:, :width].cumsum(dim=1) - 1).clamp(min=0)
        lengths = cache.valid[:, :width].sum(dim=1)
        logits = forward_with_cache(self._model, prompt_ids.to(self._device), cache)

        stop = torch.tensor(sampling.stop_token_ids, dtype=torch.int64, device=self._device)
        done = torch.zeros(len(rows), dtype=torch.bool, device=self._device)
        stopped = torch.zeros_like(done)
        tokens: list[torch.Tensor] = []
        log_probs: list[torch.Tensor] = []
        counts = torch.zeros(len(rows), dtype=torch.int64, device=self._device)
        for step in range(sampling.max_tokens):
            chosen = sample_next(logits, sampling, generator)
            chosen = torch.where(done, self._pad, chosen)
            tokens.append(chosen)
            log_probs.append(logits.log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1))
            counts += (~done).long()
            hit = torch.isin(chosen, stop) & ~done
            stopped |= hit
            done |= hit
            if step == sampling.max_tokens - 1 or bool(done.all()):
                break
            slot = width + step
            cache.valid[:, slot] = ~done
            cache.positions[:, slot] = lengths
            lengths = lengths + (~done).long()
            logits = forward_with_cache(self._model, chosen[:, None], cache)
        return self._completions(tokens, log_probs, counts, stopped, group)

    def _completions(
        self,
        tokens: list[torch.Tensor],
        log_probs: list[torch.Tensor],
        counts: torch.Tensor,
        stopped: torch.Tensor,
        group: int,
    ) -> list[Completion]:
        token_matrix = torch.stack(tokens, dim=1).cpu()
        log_prob_matrix = torch.stack(log_probs, dim=1).float().cpu()
        out: list[Completion] = []
        lengths = [int(n) for n in counts.cpu()]
        hits = [bool(h) for h in stopped.cpu()]
        for index, (count, hit) in enumerate(zip(lengths, hits, strict=True)):
            reason: FinishReason = "stop" if hit else "length"
            row = [int(t) for t in token_matrix[index, :count]]
            out.append(
                Completion(
                    prompt_index=index // group,
                    token_ids=tuple(row),
                    log_probs=log_prob_matrix[index, :count].clone(),
                    finish_reason=reason,
                )
            )
        return out
