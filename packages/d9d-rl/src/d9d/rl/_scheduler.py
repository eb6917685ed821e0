"""Continuous batching: which rows run the next forward, with blocks for their new tokens.

Rows wait in order; up to ``max_rows`` run at once. A row that finishes gives its slot and its
blocks back at once, and the next waiting row is admitted (its whole prompt is prefilled in the
next forward, while the others decode one token), or, with ``config.admission_wait_steps``, up to
that many forwards later together with the rows admitted to the slots freed meanwhile. A running
row takes a block when its tokens reach it; when the pool is empty the most recently admitted row
is preempted: its blocks are freed and it waits again at the front, to be recomputed from its
prompt and the tokens sampled so far.

A step's tokens may be recorded in two halves, so the engine can launch the next decode step
before it reads this one's tokens on the host: ``record_launched`` appends a placeholder per row
(the row's length, blocks and length limits are known without the token), ``resolve`` fills them in
later and finishes the rows that sampled a stop token, dropping what a later step computed for them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from d9d.rl._block_pool import BlockPool
from d9d.rl._engine_config import EmbeddedEngineConfig
from d9d.rl._rollout_engine import FinishReason

PENDING_TOKEN = -1
"""A launched step's token not yet read on the host (``record_launched``; ``resolve`` fills it in)."""


@dataclass(kw_only=True, eq=False)
class SequenceState:
    """One row of a ``generate`` call (compared by identity: the scheduler's lists find rows fast).

    Attributes:
        index: The row's place in the call's output (prompt-major, samples adjacent).
        prompt_length: Tokens of its prompt at the start of ``tokens``.
        max_tokens: Most tokens to sample.
        tokens: The prompt, then the sampled tokens.
        log_probs: Log-probability of each sampled token.
        cached: Tokens of ``tokens`` whose keys and values are in the cache.
        blocks: The row's block table (empty while waiting).
        finish_reason: Set when the row is done.
    """

    index: int
    prompt_length: int
    max_tokens: int
    tokens: list[int]
    log_probs: list[float] = field(default_factory=list[float])
    cached: int = 0
    blocks: list[int] = field(default_factory=list[int])
    finish_reason: FinishReason | None = None

    @property
    def completion_length(self) -> int:
        """Tokens sampled so far."""
        return len(self.tokens) - self.prompt_length

    @property
    def new_tokens(self) -> list[int]:
        """The tokens the next forward runs (not yet cached)."""
        return self.tokens[self.cached :]


class ContinuousScheduler:
    """Admits, grows, preempts and finishes the rows of one ``generate`` call.

    Args:
        rows: The call's prompts, one per row (samples of a prompt repeated).
        config: Rows at once, page size and context.
        pool: The call's block pool.
        max_tokens: Per row, most tokens to sample.
        stop_token_ids: Sampling one of these finishes a row (the token is kept).
    """

    def __init__(
        self,
        rows: list[list[int]],
        *,
        config: EmbeddedEngineConfig,
        pool: BlockPool,
        max_tokens: list[int],
        stop_token_ids: tuple[int, ...],
    ) -> None:
        self._config = config
        self._pool = pool
        self._stop = frozenset(stop_token_ids)
        self._waiting = deque(
            SequenceState(index=index, prompt_length=len(row), max_tokens=cap, tokens=list(row))
            for index, (row, cap) in enumerate(zip(rows, max_tokens, strict=True))
        )
        self._running: list[SequenceState] = []
        self.finished: list[SequenceState] = []
        self.preemptions = 0
        self.admissions = 0
        self._forwards = 0  # schedule() calls so far
        self._slot_freed_at: int | None = None  # forward at which an unfilled slot freed

    @property
    def done(self) -> bool:
        """No row waits or runs."""
        return not self._waiting and not self._running

    def schedule(self) -> list[SequenceState]:
        """The rows of the next forward, each holding blocks for its new tokens, in admission order."""
        self._forwards += 1
        self._grow_running()
        self._admit()
        if not self._running:
            raise RuntimeError("no row could be scheduled: the block pool cannot hold the next prompt")
        return list(self._running)

    def can_decode_ahead(self) -> bool:
        """Whether the next step may be scheduled before the placeholders are resolved: rows run,
        no admission is due at that step, and every running row's next block is free (no preemption)."""
        if not self._running:
            return False
        if self._admission_due(self._forwards + 1):
            return False
        need = sum(self._config.blocks_for(len(row.tokens)) - len(row.blocks) for row in self._running)
        return need <= self._pool.free_count

    def record(self, rows: list[SequenceState], tokens: list[int], log_probs: list[float]) -> None:
        """Appends each row's sampled token; finishes rows on a stop token, ``max_tokens`` or the context."""
        self.resolve(rows, self.record_launched(rows), tokens, log_probs)

    def record_launched(self, rows: list[SequenceState]) -> list[int]:
        """Appends a ``PENDING_TOKEN`` to each row (its token is on the device); finishes rows that
        reach ``max_tokens`` or the context.

        Returns:
            Each row's index of the placeholder in its ``tokens``, for ``resolve``.
        """
        positions: list[int] = []
        for row in rows:
            positions.append(len(row.tokens))
            row.cached = len(row.tokens)
            row.tokens.append(PENDING_TOKEN)
            row.log_probs.append(float("nan"))
            if row.completion_length >= row.max_tokens or len(row.tokens) >= self._config.max_context:
                self._finish(row, "length")
        return positions

    def resolve(
        self, rows: list[SequenceState], positions: list[int], tokens: list[int], log_probs: list[float]
    ) -> None:
        """Fills in the placeholders ``record_launched`` returned; a row that sampled a stop token
        finishes there, and any later placeholders of it are dropped (their step's results too)."""
        for row, position, token, log_prob in zip(rows, positions, tokens, log_probs, strict=True):
            if position >= len(row.tokens):
                continue  # an earlier token of the row was a stop token
            row.tokens[position] = token
            row.log_probs[position - row.prompt_length] = log_prob
            if token not in self._stop:
                continue
            del row.tokens[position + 1 :]
            del row.log_probs[position + 1 - row.prompt_length :]
            if row.finish_reason is None:
                self._finish(row, "stop")
            else:  # finished by length at this token or a later one, before the stop was known
                row.finish_reason = "stop"

    def _grow_running(self) -> None:
        for row in list(self._running):
            if not row.blocks:  # preempted by an earlier row of this loop (a running row holds blocks)
                continue
            need = self._config.blocks_for(len(row.tokens)) - len(row.blocks)
            while need > self._pool.free_count:
                victim = self._running[-1]
                self._preempt(victim)
                if victim is row:
                    break
            else:
                row.blocks += self._pool.take(need)

    def _admission_due(self, forward: int) -> bool:
        """Whether waiting prompts are admitted at ``forward`` (``config.admission_wait_steps``)."""
        max_rows = self._config.max_rows
        if not self._waiting or len(self._running) >= max_rows:
            return False
        if not self._running or self._slot_freed_at is None:
            return True
        if max_rows - len(self._running) >= len(self._waiting):
            return True
        return forward - self._slot_freed_at > self._config.admission_wait_steps

    def _admit(self) -> None:
        if not self._admission_due(self._forwards):
            return
        self._admit_what_fits()
        if not self._waiting or len(self._running) >= self._config.max_rows:
            self._slot_freed_at = None

    def _admit_what_fits(self) -> None:
        while self._waiting and len(self._running) < self._config.max_rows:
            need = self._config.blocks_for(len(self._waiting[0].tokens))
            if need > self._pool.free_count:
                return
            row = self._waiting.popleft()
            row.blocks = self._pool.take(need)
            self._running.append(row)
            self.admissions += 1

    def _preempt(self, row: SequenceState) -> None:
        self._release(row)
        row.cached = 0
        self._waiting.appendleft(row)
        self.preemptions += 1

    def _finish(self, row: SequenceState, reason: FinishReason) -> None:
        row.finish_reason = reason
        self._release(row)
        self.finished.append(row)

    def _release(self, row: SequenceState) -> None:
        if self._slot_freed_at is None:
            self._slot_freed_at = self._forwards
        self._pool.give_back(row.blocks)
        row.blocks = []
        self._running.remove(row)
