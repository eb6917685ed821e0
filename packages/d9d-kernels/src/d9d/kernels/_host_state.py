"""Optimizer moments kept in host memory and streamed through the device, a chunk at a time."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

GIB = 2**30
_SEED_STRIDE = 0x9E3779B1  # a slice of a split parameter rounds with its own seed, not its first slice's


def available_host_memory() -> int:
    """Bytes of host memory a process can still take: ``MemAvailable``, else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB ({nbytes} bytes)"


@dataclass(kw_only=True, frozen=True)
class HostStateOffload:
    """Keep an optimizer's moments in (pinned) host memory; each step streams them through the device.

    Attributes:
        chunk_bytes: Moment bytes per chunk. Two chunks are on the device at a time (one being
            stepped while the next arrives and the previous leaves), so the device holds about
            ``2 * chunk_bytes`` for the step. A parameter larger than a chunk is stepped in slices.
        resident_bytes: Moment bytes that stay on the device (those of the first parameters that
            fit), so that a device with memory to spare copies less at each step.
        processes_per_host: Processes on this host that offload at once (one per GPU); each may
            take this share of the host's free memory.
        available_host_bytes: How much host memory is free (``/proc/meminfo`` by default); the
            optimizer refuses to start when the moments need more.
    """

    chunk_bytes: int = 512 * 2**20
    resident_bytes: int = 0
    processes_per_host: int = 1
    available_host_bytes: Callable[[], int] = field(default=available_host_memory)

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            raise ValueError(f"HostStateOffload: chunk_bytes={self.chunk_bytes} must be > 0")
        if self.resident_bytes < 0:
            raise ValueError(f"HostStateOffload: resident_bytes={self.resident_bytes} must be >= 0")
        if self.processes_per_host < 1:
            raise ValueError(f"HostStateOffload: processes_per_host={self.processes_per_host} must be >= 1")

    def check_fits(self, needed_bytes: int, *, what: str) -> None:
        """Refuses ``needed_bytes`` of host state that the host cannot hold, before any is allocated.

        Raises:
            ValueError: Naming the bytes needed and available.
        """
        free = self.available_host_bytes()
        share = free // self.processes_per_host
        if needed_bytes > share:
            shared = f" ({_size(free)} free, shared by {self.processes_per_host} processes)"
            raise ValueError(
                f"{what}: optimizer state offloaded to the host needs {_size(needed_bytes)} of pinned "
                f"host memory, but only {_size(share)} is available"
                f"{shared if self.processes_per_host > 1 else ''}; free host memory, keep more of the "
                f"state on the device (resident_bytes, or no offload), or use bf16 moments (state_dtype)"
            )


@dataclass(kw_only=True, frozen=True)
class StreamedOperands:
    """One parameter's (or slice's) operands: ``param`` and ``grad`` on the device, moments on the host."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    seed: int

    @property
    def state_bytes(self) -> int:
        return self.exp_avg.nbytes + self.exp_avg_sq.nbytes


StepRunner = Callable[
    [list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[int]], None
]
"""Steps device lists ``(params, grads, exp_avgs, exp_avg_sqs)`` with one rounding seed per entry."""


def _slices(operands: StreamedOperands, chunk_bytes: int) -> list[StreamedOperands]:
    """The parameter whole, or flat contiguous slices of it whose moments fit in a chunk."""
    per_element = operands.exp_avg.element_size() + operands.exp_avg_sq.element_size()
    if operands.state_bytes <= chunk_bytes:
        return [operands]
    length = max(1, chunk_bytes // per_element)
    flat = [t.reshape(-1) for t in (operands.param, operands.grad, operands.exp_avg, operands.exp_avg_sq)]
    return [
        StreamedOperands(
            param=flat[0][start : start + length],
            grad=flat[1][start : start + length],
            exp_avg=flat[2][start : start + length],
            exp_avg_sq=flat[3][start : start + length],
            seed=(operands.seed + index * _SEED_STRIDE) % (2**31 - 1),
        )
        for index, start in enumerate(range(0, flat[0].numel(), length))
    ]


def plan_chunks(operands: Sequence[StreamedOperands], chunk_bytes: int) -> list[list[StreamedOperands]]:
    """Groups the operands, in order, into chunks of at most ``chunk_bytes`` of moments."""
    chunks: list[list[StreamedOperands]] = []
    current: list[StreamedOperands] = []
    size = 0
    for piece in (s for o in operands for s in _slices(o, chunk_bytes)):
        if current and size + piece.state_bytes > chunk_bytes:
            chunks.append(current)
            current, size = [], 0
        current.append(piece)
        size += piece.state_bytes
    if current:
        chunks.append(current)
    return chunks


@dataclass(kw_only=True)
class _Slot:
    """Device scratch for one chunk's moments; ``freed`` marks when its last copy back finished."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    freed: torch.cuda.Event | None = None


class HostStateStreamer:
    """Steps parameters whose moments live on the host: moments in, fused step, moments out.

    State: two device slots of scratch (one being stepped while the other is loaded or written
    back), the copy streams on CUDA, and the events of the copies still in flight. On CUDA the
    host-to-device copies run on one stream and the device-to-host copies on another, so chunk
    ``i + 1`` arrives and chunk ``i - 1`` leaves while chunk ``i`` is stepped on the current
    stream; the last copies back overlap whatever the device runs next. Elsewhere (CPU) the same
    copies run in order, without streams.

    Args:
        device: Where the parameters and gradients are and the step runs.
        chunk_bytes: Moment bytes per chunk.
    """

    def __init__(self, *, device: torch.device, chunk_bytes: int) -> None:
        self._device = device
        self._chunk_bytes = chunk_bytes
        self._slots: dict[tuple[torch.dtype, torch.dtype], list[_Slot]] = {}
        cuda = device.type == "cuda"
        self._copy_in = torch.cuda.Stream(device) if cuda else None
        self._copy_out = torch.cuda.Stream(device) if cuda else None

    def wait(self) -> None:
        """Blocks until every moment copied back to the host has landed (before reading it there)."""
        if self._copy_out is not None and self._copy_in is not None:
            self._copy_out.synchronize()
            self._copy_in.synchronize()

    def _slots_for(self, dtypes: tuple[torch.dtype, torch.dtype], numel: int) -> list[_Slot]:
        slots = self._slots.get(dtypes)
        if slots is None or slots[0].exp_avg.numel() < numel:
            self.wait()  # the old scratch may still be read by a copy in flight
            slots = [
                _Slot(
                    exp_avg=torch.empty(numel, dtype=dtypes[0], device=self._device),
                    exp_avg_sq=torch.empty(numel, dtype=dtypes[1], device=self._device),
                )
                for _ in range(2)
            ]
            self._slots[dtypes] = slots
        return slots

    def step(self, operands: Sequence[StreamedOperands], run: StepRunner) -> None:
        """Streams every operand's moments through the device and steps them with ``run``.

        Every operand's moments must share one pair of dtypes (one bucket of the optimizer).
        """
        chunks = plan_chunks(operands, self._chunk_bytes)
        if not chunks:
            return
        dtypes = (chunks[0][0].exp_avg.dtype, chunks[0][0].exp_avg_sq.dtype)
        slots = self._slots_for(dtypes, max(sum(p.exp_avg.numel() for p in chunk) for chunk in chunks))
        for index, chunk in enumerate(chunks):
            slot = slots[index % 2]
            device_moments: list[tuple[torch.Tensor, torch.Tensor]] = []
            offset = 0
            for piece in chunk:
                size = piece.exp_avg.numel()
                device_moments.append(
                    (
                        slot.exp_avg[offset : offset + size].view(piece.exp_avg.shape),
                        slot.exp_avg_sq[offset : offset + size].view(piece.exp_avg_sq.shape),
                    )
                )
                offset += size
            self._run_chunk(slot, chunk, device_moments, run)

    def _run_chunk(
        self,
        slot: _Slot,
        chunk: list[StreamedOperands],
        device_moments: list[tuple[torch.Tensor, torch.Tensor]],
        run: StepRunner,
    ) -> None:
        copy_in, copy_out = self._copy_in, self._copy_out
        if copy_in is None or copy_out is None:
            for piece, (exp_avg, exp_avg_sq) in zip(chunk, device_moments, strict=True):
                exp_avg.copy_(piece.exp_avg)
                exp_avg_sq.copy_(piece.exp_avg_sq)
            self._run(chunk, device_moments, run)
            for piece, (exp_avg, exp_avg_sq) in zip(chunk, device_moments, strict=True):
                piece.exp_avg.copy_(exp_avg)
                piece.exp_avg_sq.copy_(exp_avg_sq)
            return
        compute = torch.cuda.current_stream(self._device)
        freed = slot.freed
        with torch.cuda.stream(copy_in):
            if freed is None:
                copy_in.wait_stream(copy_out)
            else:
                copy_in.wait_event(freed)  # chunk ``i - 2`` has left this slot
            for piece, (exp_avg, exp_avg_sq) in zip(chunk, device_moments, strict=True):
                exp_avg.copy_(piece.exp_avg, non_blocking=True)
                exp_avg_sq.copy_(piece.exp_avg_sq, non_blocking=True)
        compute.wait_stream(copy_in)
        self._run(chunk, device_moments, run)
        with torch.cuda.stream(copy_out):
            copy_out.wait_stream(compute)
            for piece, (exp_avg, exp_avg_sq) in zip(chunk, device_moments, strict=True):
                piece.exp_avg.copy_(exp_avg, non_blocking=True)
                piece.exp_avg_sq.copy_(exp_avg_sq, non_blocking=True)
            event = torch.cuda.Event()
            event.record(copy_out)
        slot.freed = event

    @staticmethod
    def _run(
        chunk: list[StreamedOperands],
        device_moments: list[tuple[torch.Tensor, torch.Tensor]],
        run: StepRunner,
    ) -> None:
        run(
            [piece.param for piece in chunk],
            [piece.grad for piece in chunk],
            [moments[0] for moments in device_moments],
            [moments[1] for moments in device_moments],
            [piece.seed for piece in chunk],
        )
