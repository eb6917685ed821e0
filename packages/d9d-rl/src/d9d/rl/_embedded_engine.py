"""A rollout engine inside the trainer's process, on a d9d-hf causal LM of any family."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from d9d.hf import DecoderCausalLM
from d9d.loop import TensorOffloader
from d9d.rl._block_pool import BlockPool
from d9d.rl._decode_runtime import DecodeRuntime, DeviceTokens
from d9d.rl._decode_step import FewRowsLinears, compile_decode_rows
from d9d.rl._engine_config import EmbeddedEngineConfig
from d9d.rl._kv_cache import compile_paged_logits
from d9d.rl._launched_step import LaunchedStep
from d9d.rl._pinned_copy import to_device
from d9d.rl._rollout_engine import Completion, SamplingParams
from d9d.rl._sampling import sample_keyed
from d9d.rl._scheduler import ContinuousScheduler, SequenceState


@dataclass(kw_only=True, frozen=True)
class EngineStats:
    """What the last ``generate`` call did.

    Attributes:
        rows: Completions produced.
        forwards: Model forwards (a step with both prefills and decodes runs two).
        admissions: Rows admitted (a preempted row counts again when readmitted).
        preemptions: Rows preempted for lack of free blocks.
        pool_blocks: Blocks in the call's pool.
        peak_blocks: Most blocks held at once.
        free_blocks_after: Free blocks when the call ended (all of them: no row keeps any).
        decode_steps: Forwards of the static decode step (rows with one new token).
        decode_ahead_steps: Of those, steps launched before the host had read the previous step's
            tokens (``EmbeddedEngineConfig.decode_ahead``).
        decode_context_tokens: Over those steps, the sum of each decoding row's length: the
            cached tokens whose keys and values they read.
        graph_buckets: Batch-size buckets with a captured CUDA graph after the call (none
            without graphs).
        decode_seconds: Device time of the decode steps (CUDA events on CUDA, the wall clock
            elsewhere): the call's time less prefills, sampling and the host's planning between
            steps.
        prefill_seconds: Device time of the prefill forwards, measured the same way.
        warm_up_seconds: Host time of the call's first runs in the engine's current pool: each
            CUDA-graph bucket's warm-up and capture, and with ``compile_decode`` /
            ``compile_prefill`` the first decode step and prefill of one row and of several
            (compilation, autotuning). Each is also logged at INFO on the ``d9d.rl`` logger as it
            ends. 0 once every kind has run (a later call on the same pool).
    """

    rows: int
    forwards: int
    admissions: int
    preemptions: int
    pool_blocks: int
    peak_blocks: int
    free_blocks_after: int
    decode_steps: int
    decode_ahead_steps: int
    decode_context_tokens: int
    graph_buckets: tuple[int, ...]
    decode_seconds: float
    prefill_seconds: float
    warm_up_seconds: float


class EmbeddedRolloutEngine:
    """Continuous batching over a paged KV cache, on a whole ``DecoderCausalLM``; a ``RolloutEngine``.

    The engine owns ``model`` (its own copy of the policy, e.g. built from the same config and fed
    by ``stream_weights``). Up to ``config.max_rows`` rows decode at once; a row that finishes
    frees its slot and its cache blocks, and the next waiting row (prompts in order, the samples
    of a prompt adjacent) is admitted: its prompt is prefilled in the same step as the others'
    decode. Keys and values live in blocks of ``config.page_size`` tokens taken from a pool as
    tokens are generated. Each row's positions start at 0 as in training. Decoding rows run a
    static decode step: its state lives in device buffers that one small host-to-device copy per
    step updates, its attention reads the pool in place (d9d-kernels' ``paged_decode_attention``),
    and on CUDA it is captured once per batch-size bucket in a CUDA graph and replayed
    (``config.cuda_graphs``), compiled first with ``config.compile_decode``; prefills run eagerly unless
    ``config.compile_prefill``.
    While the running rows only decode, the host schedules and launches the next step before it
    reads the current step's tokens (``config.decode_ahead``): the next step takes them on the
    device, so the device does not wait for the host between steps.
    Log-probabilities are those of the model's own distribution (temperature 1, no filtering),
    equal to the trainer's forward on the same tokens. Sampling draws each token with noise keyed
    by (seed, row, token index), so a seeded call gives the same completions whatever the
    admission order, rows at once or preemptions (up to floating-point differences between batch
    shapes).

    State: the weights (``update_weights`` copies into them), a seeded generator that every
    unseeded ``generate`` call advances, and the pool with the decode step's buffers and graphs,
    kept between calls (a call that needs a larger pool replaces them); ``sleep`` frees the pool
    and the graphs and moves the weights to the host.

    Args:
        model: The whole model (first and last pipeline stage), on the device to generate on.
        seed: Seeds the engine's generator.
        pad_token_id: Fills padding slots (never attended to).
        config: Rows at once, page size, context, pool size and CUDA graphs.

    Raises:
        ValueError: If ``config.cuda_graphs`` is True and the model is not on a CUDA device, or
            ``config.prefill_graphs`` is True and the decode step runs without CUDA graphs.
    """

    def __init__(
        self,
        model: DecoderCausalLM,
        *,
        seed: int = 0,
        pad_token_id: int = 0,
        config: EmbeddedEngineConfig | None = None,
    ) -> None:
        model.require_whole_model("EmbeddedRolloutEngine")
        self._model = model.eval().requires_grad_(False)
        self._device = next(model.parameters()).device
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._pad = pad_token_id
        self._config = EmbeddedEngineConfig() if config is None else config
        graphs = self._config.cuda_graphs
        if graphs and self._device.type != "cuda":
            raise ValueError(
                f"EmbeddedEngineConfig.cuda_graphs=True needs a CUDA device; the model is on "
                f"{self._device}. Leave cuda_graphs unset (None: on for CUDA only) or set it to False"
            )
        self._cuda_graphs = self._device.type == "cuda" if graphs is None else graphs
        if self._config.prefill_graphs is True and not self._cuda_graphs:
            raise ValueError(
                f"EmbeddedEngineConfig.prefill_graphs=True needs the decode step in CUDA graphs (a CUDA "
                f"device, cuda_graphs not False); the model is on {self._device} with cuda_graphs="
                f"{graphs}. Set prefill_graphs to False"
            )
        few_rows = self._config.few_rows_linear
        # an eager step without graphs would pay the mode's dispatch on the host at every step
        replayed_or_compiled = self._cuda_graphs or self._config.compile_decode
        use_kernel = self._device.type == "cuda" and replayed_or_compiled if few_rows is None else few_rows
        self._few_rows_linear: FewRowsLinears = (
            "off" if not use_kernel else "grouped" if self._config.few_rows_linear_group else "each"
        )
        # one compiled region per engine: its graphs serve every pool the engine allocates
        self._compiled_decode = (
            compile_decode_rows(self._config.max_rows, self._config.compile_backend)
            if self._config.compile_decode
            else None
        )
        compile_prefill = self._config.compile_prefill
        if compile_prefill is None:
            compile_prefill = self._config.compile_decode
        self._compiled_prefill = (
            compile_paged_logits(self._config.max_rows, self._config.compile_backend)
            if compile_prefill
            else None
        )
        prefill_graphs = self._config.prefill_graphs
        self._prefill_graphs = (
            self._cuda_graphs and not compile_prefill if prefill_graphs is None else prefill_graphs
        )
        self._runtime: DecodeRuntime | None = None
        self._weights = model.state_dict()
        self._offloader = TensorOffloader(self._device)
        self._last_stats: EngineStats | None = None

    @property
    def config(self) -> EmbeddedEngineConfig:
        """How the engine batches and pages."""
        return self._config

    @property
    def last_stats(self) -> EngineStats | None:
        """What the last ``generate`` call did (None before the first)."""
        return self._last_stats

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
        """Frees the pool and the decode graphs, moves the weights to the host (pinned on CUDA)
        and frees the allocator's cache."""
        self._runtime = None
        if not self._offloader.is_offloaded:
            self._offloader.offload([*self._model.parameters(), *self._model.buffers()])

    def wake(self) -> None:
        """Brings the weights back, bit-exact."""
        if self._offloader.is_offloaded:
            self._offloader.restore()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        """Samples ``sampling.samples_per_prompt`` completions per prompt (adjacent, in prompt order).

        Raises:
            RuntimeError: If the engine is asleep.
            ValueError: If a prompt is empty or has ``config.max_context`` tokens or more.
        """
        return self.generate_capped(prompts, sampling, [sampling.max_tokens] * len(prompts))

    @torch.no_grad()
    def generate_capped(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, max_tokens: Sequence[int]
    ) -> list[Completion]:
        """``generate`` with a cap per prompt: ``max_tokens[i]`` tokens instead of ``sampling.max_tokens``.

        Rows with different caps finish at different steps; their slots go to waiting rows.

        Raises:
            RuntimeError: If the engine is asleep.
            ValueError: If a prompt is empty or has ``config.max_context`` tokens or more, or a cap
                is missing or not positive.
        """
        if self._offloader.is_offloaded:
            raise RuntimeError("the engine is asleep; wake() it before generate")
        self._check_prompts(prompts, max_tokens)
        group = sampling.samples_per_prompt
        rows = [list(prompt) for prompt in prompts for _ in range(group)]
        caps = [cap for cap in max_tokens for _ in range(group)]
        if not rows:
            return []
        seed = sampling.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._generator, device=self._device))
        pool = BlockPool(self._pool_blocks(rows, caps))
        runtime = self._runtime_for(pool.num_blocks)
        scheduler = ContinuousScheduler(
            rows,
            config=self._config,
            pool=pool,
            max_tokens=caps,
            stop_token_ids=sampling.stop_token_ids,
        )
        forwards = ahead = 0
        launched: LaunchedStep | None = None  # its tokens are not read on the host yet
        while True:
            if launched is not None and not (self._config.decode_ahead and scheduler.can_decode_ahead()):
                scheduler.resolve(launched.rows, launched.positions, *launched.read())
                launched = None
            if scheduler.done:
                break
            running = scheduler.schedule()
            logits, runs = self._forward(runtime, running, None if launched is None else launched.feed())
            forwards += runs
            step = self._sample(logits, running, sampling, seed, scheduler)
            if launched is not None:  # the device runs `step` while the host reads and records this one
                ahead += 1
                scheduler.resolve(launched.rows, launched.positions, *launched.read())
            launched = step
        self._last_stats = EngineStats(
            rows=len(rows),
            forwards=forwards,
            admissions=scheduler.admissions,
            preemptions=scheduler.preemptions,
            pool_blocks=pool.num_blocks,
            peak_blocks=pool.peak_taken,
            free_blocks_after=pool.free_count,
            decode_steps=runtime.decode_steps,
            decode_ahead_steps=ahead,
            decode_context_tokens=runtime.decode_context_tokens,
            graph_buckets=runtime.graph_buckets,
            decode_seconds=runtime.decode_seconds,
            prefill_seconds=runtime.prefill_seconds,
            warm_up_seconds=runtime.warm_up_seconds,
        )
        return self._completions(scheduler.finished, sampling.samples_per_prompt)

    def _check_prompts(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> None:
        context = self._config.max_context
        if len(max_tokens) != len(prompts):
            raise ValueError(f"{len(max_tokens)} completion caps for {len(prompts)} prompts")
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
            if len(prompt) >= context:
                raise ValueError(
                    f"prompt {index} has {len(prompt)} tokens, longer than the engine's context allows: "
                    f"max_context={context} tokens (prompt and completion together) leaves no room "
                    "for a completion"
                )
            if max_tokens[index] <= 0:
                raise ValueError(f"prompt {index}: max_tokens={max_tokens[index]} must be positive")

    def _pool_blocks(self, rows: list[list[int]], caps: list[int]) -> int:
        """``config.num_blocks``, or enough for this call's ``max_rows`` longest rows at their longest."""
        if self._config.num_blocks is not None:
            return self._config.num_blocks
        context = self._config.max_context - 1
        blocks = sorted(
            (
                self._config.blocks_for(min(len(row) + cap - 1, context))
                for row, cap in zip(rows, caps, strict=True)
            ),
            reverse=True,
        )
        return sum(blocks[: self._config.max_rows])

    def _runtime_for(self, num_blocks: int) -> DecodeRuntime:
        """The kept runtime when its pool holds ``num_blocks`` blocks, else a new one."""
        runtime = self._runtime
        if runtime is None or runtime.cache.num_blocks < num_blocks:
            self._runtime = None  # the old pool and graphs go before the new ones are allocated
            runtime = DecodeRuntime(
                self._model,
                config=self._config,
                num_blocks=num_blocks,
                pad_token_id=self._pad,
                cuda_graphs=self._cuda_graphs,
                compiled=self._compiled_decode,
                compiled_prefill=self._compiled_prefill,
                few_rows_linear=self._few_rows_linear,
                prefill_graphs=self._prefill_graphs,
            )
            self._runtime = runtime
        runtime.start_call()
        return runtime

    def _forward(
        self, runtime: DecodeRuntime, running: list[SequenceState], fed: DeviceTokens | None
    ) -> tuple[torch.Tensor, int]:
        """Next-token logits of every running row: the static decode step for the decoding rows
        (one new token each, from ``fed`` where it is still on the device) and an eager forward for
        the rows being prefilled, so a long prompt does not pad the decodes."""
        decoding = [i for i, row in enumerate(running) if len(row.tokens) - row.cached == 1]
        if len(decoding) == len(running):
            return runtime.decode(running, fed), 1
        if fed is not None:
            raise RuntimeError("a step that prefills cannot take tokens the host has not read")
        prefilling = [i for i, row in enumerate(running) if len(row.tokens) - row.cached > 1]
        parts: list[torch.Tensor] = []
        if decoding:
            parts.append(runtime.decode([running[i] for i in decoding]))
        parts.append(runtime.prefill([running[i] for i in prefilling]))
        order = decoding + prefilling
        logits = torch.cat(parts)
        if order != sorted(order):
            logits = logits[to_device(order, logits.device).argsort()]
        return logits, len(parts)

    def _sample(
        self,
        logits: torch.Tensor,
        running: list[SequenceState],
        sampling: SamplingParams,
        seed: int,
        scheduler: ContinuousScheduler,
    ) -> LaunchedStep:
        """Each row's next token and its log-probability, sampled on the device and queued for the
        host in one copy; the rows get placeholders until the engine reads it."""
        if sampling.temperature == 0.0:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sample_keyed(
                logits,
                sampling,
                seed=seed,
                rows=to_device([row.index for row in running], self._device),
                steps=to_device([row.completion_length for row in running], self._device),
            )
        log_probs = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)
        positions = scheduler.record_launched(running)
        return LaunchedStep.start(running, positions, tokens, log_probs)

    def _completions(self, finished: list[SequenceState], group: int) -> list[Completion]:
        out: list[Completion] = []
        for row in sorted(finished, key=lambda row: row.index):
            assert row.finish_reason is not None
            out.append(
                Completion(
                    prompt_index=row.index // group,
                    token_ids=tuple(row.tokens[row.prompt_length :]),
                    log_probs=torch.tensor(row.log_probs, dtype=torch.float32),
                    finish_reason=row.finish_reason,
                )
            )
        return out
