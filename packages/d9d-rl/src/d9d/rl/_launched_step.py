"""A step whose tokens were sampled on the device and are on their way to the host, not yet read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from d9d.rl._decode_runtime import DeviceTokens
from d9d.rl._scheduler import SequenceState


@dataclass(kw_only=True, frozen=True)
class LaunchedStep:
    """The sampled tokens and log-probabilities of one step's rows, queued for the host.

    Attributes:
        rows: The step's rows, in the order of ``tokens``.
        positions: Each row's index of its placeholder token (``ContinuousScheduler.record_launched``).
        tokens: ``(len(rows),)`` int64 sampled tokens, on the device.
        host: ``(2, len(rows))`` float64 tokens and log-probabilities, being copied to the host
            (pinned memory on CUDA).
        copied: Marks the copy's end on the device's stream (None off CUDA: the copy is done).
    """

    rows: list[SequenceState]
    positions: list[int]
    tokens: torch.Tensor
    host: torch.Tensor
    copied: torch.cuda.Event | None

    @classmethod
    def start(
        cls, rows: list[SequenceState], positions: list[int], tokens: torch.Tensor, log_probs: torch.Tensor
    ) -> LaunchedStep:
        """Queues the copy of ``tokens`` and ``log_probs`` (device tensors of the rows) to the host."""
        packed = torch.stack([tokens.double(), log_probs.double()])
        cuda = packed.device.type == "cuda"
        host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=cuda)
        host.copy_(packed, non_blocking=True)
        copied = None
        if cuda:
            copied = torch.cuda.Event()
            copied.record()
        return cls(rows=rows, positions=positions, tokens=tokens, host=host, copied=copied)

    def feed(self) -> DeviceTokens:
        """The tokens as the next decode step's input, by row."""
        return DeviceTokens(tokens=self.tokens, places={row.index: i for i, row in enumerate(self.rows)})

    def read(self) -> tuple[list[int], list[float]]:
        """Waits for the copy (not for steps queued after it); the tokens and log-probabilities."""
        if self.copied is not None:
            self.copied.synchronize()
        return cast(list[int], self.host[0].long().tolist()), cast(list[float], self.host[1].tolist())
