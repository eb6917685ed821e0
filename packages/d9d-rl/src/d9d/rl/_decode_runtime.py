"""What the engine keeps between steps and calls: the paged pool, the static decode step, its rows
and (on CUDA) its graphs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from d9d.hf import DecoderCausalLM
from d9d.rl._decode_graphs import GraphedDecodeStep
from d9d.rl._decode_slots import DecodeSlots
from d9d.rl._decode_step import DecodeAttention, DecodeFunction, FewRowsLinears, StaticDecodeStep
from d9d.rl._engine_config import EmbeddedEngineConfig
from d9d.rl._kv_cache import PagedBatch, PagedKVCache, PrefillFunction, forward_paged
from d9d.rl._prefill_graphs import GRAPHED_MAX_WIDTH, GraphedPrefill, StaticPrefill, width_bucket
from d9d.rl._scheduler import SequenceState

_LOG = logging.getLogger("d9d.rl")


@dataclass(kw_only=True, frozen=True)
class DeviceTokens:
    """A launched step's sampled tokens on the device, feeding the next step before the host reads them.

    Attributes:
        tokens: ``(n,)`` int64, the step's tokens in its rows' order.
        places: Each row's (``SequenceState.index``) place in ``tokens``.
    """

    tokens: torch.Tensor
    places: Mapping[int, int]


class _DeviceTimer:
    """Sums the device time of spans without synchronizing inside them.

    On CUDA each span records into the next of a pool of reusable timing-event pairs (a pair is
    allocated only when the pool runs out), on the current stream; ``seconds`` reads the pairs used
    since ``reset`` once (after the call, when its results have reached the host), and ``reset``
    rewinds to the pool's start without freeing it. Elsewhere the device is synchronous and the
    wall clock is its time.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._used = 0
        self._open = False
        self._wall = 0.0
        self._wall_started: float | None = None

    def start(self) -> None:
        if self._cuda:
            if self._used == len(self._pairs):
                self._pairs.append(
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                )
            self._pairs[self._used][0].record()
            self._open = True
        else:
            self._wall_started = time.perf_counter()

    def stop(self) -> None:
        if self._open:
            self._pairs[self._used][1].record()
            self._used += 1
            self._open = False
        elif self._wall_started is not None:
            self._wall += time.perf_counter() - self._wall_started
            self._wall_started = None

    def seconds(self) -> float:
        used = self._pairs[: self._used]
        if used:
            used[-1][1].synchronize()
        return self._wall + sum(start.elapsed_time(end) for start, end in used) / 1e3

    def reset(self) -> None:
        self._used = 0
        self._open = False
        self._wall = 0.0


class DecodeRuntime:
    """The pool of ``num_blocks`` blocks, the decode step's buffers and graphs, for one engine.

    Decoding rows (one new token each) run the static decode step (compiled with ``compiled``, a
    replayed CUDA graph with ``cuda_graphs``); rows being prefilled run the model over the pool
    (``forward_paged``, compiled with ``compiled_prefill``). A ``generate`` call reuses the runtime
    when its pool is large enough.

    Args:
        model: The whole model.
        config: The engine's configuration.
        num_blocks: Blocks of the pool.
        pad_token_id: Input token of idle rows and padding.
        cuda_graphs: Capture and replay the decode step (CUDA only).
        compiled: The engine's compiled ``decode_rows`` (``compile_decode``), or None: eager.
        compiled_prefill: The engine's compiled ``paged_logits`` (``compile_prefill``), or None: eager.
        few_rows_linear: How the decode step's linears run.
        prefill_graphs: Also replay a CUDA graph per width bucket for the prefill of one fresh
            prompt (``StaticPrefill``; CUDA only).
    """

    def __init__(
        self,
        model: DecoderCausalLM,
        *,
        config: EmbeddedEngineConfig,
        num_blocks: int,
        pad_token_id: int,
        cuda_graphs: bool,
        compiled: DecodeFunction | None = None,
        compiled_prefill: PrefillFunction | None = None,
        few_rows_linear: FewRowsLinears = "off",
        prefill_graphs: bool = False,
    ) -> None:
        device = next(model.parameters()).device
        self._model = model
        self._compiled_prefill = compiled_prefill
        self._pad = pad_token_id
        self.cache = PagedKVCache.empty(
            model, num_blocks=num_blocks, page_size=config.page_size, device=device
        )
        self._step = StaticDecodeStep(
            model,
            self.cache,
            max_rows=config.max_rows,
            max_blocks=config.blocks_for(config.max_context),
            compiled=compiled,
            few_rows_linear=few_rows_linear,
            attention=DecodeAttention(
                fused_pool_write=config.fused_pool_write,
                longest_rows_first=config.longest_rows_first,
                fused_qk_norm_rope=config.fused_qk_norm_rope,
            ),
        )
        self._slots = DecodeSlots(config.max_rows, pad_token_id=pad_token_id)
        self._graphs = GraphedDecodeStep(self._step) if cuda_graphs else None
        self._prefill_graphs = (
            GraphedPrefill(
                StaticPrefill(model, self.cache, pad_token_id=pad_token_id, compiled=compiled_prefill)
            )
            if prefill_graphs
            else None
        )
        self.decode_steps = 0
        self.decode_context_tokens = 0
        self._decode_timer = _DeviceTimer(device)
        self._prefill_timer = _DeviceTimer(device)
        self._first_runs: set[str] = set()
        self.warm_up_seconds = 0.0

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """Batch-size buckets with a captured graph (none without graphs)."""
        return () if self._graphs is None else tuple(self._graphs.captured)

    def start_call(self) -> None:
        """Forgets the previous call's rows and counts."""
        self._slots.reset()
        self.decode_steps = 0
        self.decode_context_tokens = 0
        self._decode_timer.reset()
        self._prefill_timer.reset()
        self.warm_up_seconds = 0.0

    @property
    def decode_seconds(self) -> float:
        """Device time of this call's decode steps (loading their rows, the step, its logits)."""
        return self._decode_timer.seconds()

    @property
    def prefill_seconds(self) -> float:
        """Device time of this call's prefill forwards."""
        return self._prefill_timer.seconds()

    def decode(self, rows: Sequence[SequenceState], fed: DeviceTokens | None = None) -> torch.Tensor:
        """``(len(rows), vocab)`` float32 next-token logits of rows with one new token each.

        Args:
            rows: The decoding rows.
            fed: The previous step's sampled tokens, still on the device, for the rows whose new
                token is a placeholder (``PENDING_TOKEN``).
        """
        update = self._slots.plan(rows, None if fed is None else fed.places)
        self._decode_timer.start()
        order = self._step.load(update, None if fed is None else fed.tokens)
        self.decode_steps += 1
        self.decode_context_tokens += sum(update.lengths)
        graphs = self._graphs
        if graphs is not None:
            first = None if graphs.has(update.rows) else f"decode step of {update.rows} rows"
            logits = self._first_run(first, lambda: graphs.forward(update.rows))
        else:
            blocks = max(len(row.blocks) for row in rows)
            first = None
            if self._step.compiled:
                first = f"decode step of {'one row' if update.rows == 1 else 'several rows'}"
            logits = self._first_run(first, lambda: self._step.forward(update.rows, blocks))
        self._decode_timer.stop()
        if update.order == list(range(len(rows))):
            return logits[: len(rows)]
        return logits[order.long()]

    def prefill(self, rows: Sequence[SequenceState]) -> torch.Tensor:
        """``(len(rows), vocab)`` float32 logits at the last token of rows with several new tokens."""
        self._prefill_timer.start()
        graphed = self._prefill_graphs
        row = rows[0]
        if (
            graphed is not None
            and len(rows) == 1
            and row.cached == 0
            and len(row.tokens) <= GRAPHED_MAX_WIDTH
        ):
            width = width_bucket(len(row.tokens))
            first = None if graphed.has(width) else f"prefill of one prompt {width} tokens wide"
            logits = self._first_run(first, lambda: graphed.prefill(row.tokens, row.blocks))
        else:
            batch = PagedBatch(
                tokens=[row.new_tokens for row in rows],
                starts=[row.cached for row in rows],
                blocks=[row.blocks for row in rows],
            )
            kind = "one row" if len(rows) == 1 else "several rows"
            first = f"prefill of {kind}" if self._compiled_prefill is not None else None
            logits = self._first_run(
                first,
                lambda: forward_paged(
                    self._model, self.cache, batch, pad_token_id=self._pad, compiled=self._compiled_prefill
                ),
            )
        self._prefill_timer.stop()
        return logits

    def _first_run(self, label: str | None, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Runs ``run``; the first run of ``label`` in this runtime (a CUDA-graph bucket's warm-up
        and capture, a compiled function's first call of one row or of several: compilation,
        autotuning) is timed on the host, logged and added to ``warm_up_seconds``. None: not timed."""
        if label is None or label in self._first_runs:
            return run()
        started = time.perf_counter()
        logits = run()
        seconds = time.perf_counter() - started
        self._first_runs.add(label)
        self.warm_up_seconds += seconds
        _LOG.info("engine warm-up: first %s in %.1f s", label, seconds)
        return logits
