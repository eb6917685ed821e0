"""Sleep and wake: move a set of tensors' storage to host memory and back, bit-exact.

Used between steps by colocated RL: the trainer sleeps while a rollout engine generates on the
same accelerator. Storages, not tensors, move: every tensor object, view and alias (FSDP's flat
shards, tied weights, optimizer references) stays valid, and only the bytes leave the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(kw_only=True, frozen=True)
class SleepStarted:
    """The trainer is about to move its parameters, gradients and optimizer state to the host."""

    step: int


@dataclass(kw_only=True, frozen=True)
class SleepFinished:
    """The trainer's state is on the host and the allocator's cache is empty.

    Attributes:
        step: Optimizer steps completed so far.
        bytes_moved: Bytes copied to the host.
        seconds: Wall time of the copy (synchronized) and the cache release.
    """

    step: int
    bytes_moved: int
    seconds: float


@dataclass(kw_only=True, frozen=True)
class WakeStarted:
    """The trainer is about to bring its state back to the device."""

    step: int


@dataclass(kw_only=True, frozen=True)
class WakeFinished:
    """The trainer's state is back on the device, bit-identical to before ``sleep``."""

    step: int
    bytes_moved: int
    seconds: float


@dataclass(kw_only=True)
class _Offloaded:
    storage: torch.UntypedStorage
    host: torch.Tensor


def _device_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over ``storage`` (for tensor copies, which overlap with the host)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TensorOffloader:
    """Moves the storages of tensors on ``device`` to host memory and back.

    State: while offloaded, each storage has size 0 and its bytes live in a host buffer (pinned on
    CUDA). The host buffers are kept after ``restore`` and reused by the next ``offload`` of
    storages of the same sizes, so a sleep/wake cycle allocates no pinned memory after the first.
    Costs one copy of the offloaded bytes in host memory for the offloader's lifetime.

    Args:
        device: Only storages on this device move (on CPU the same path runs: a host copy, the
            storage released, then refilled).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._offloaded: list[_Offloaded] = []
        self._hosts: list[torch.Tensor] = []

    @property
    def is_offloaded(self) -> bool:
        """Whether the tensors' bytes are on the host now."""
        return bool(self._offloaded)

    def _storages(self, tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
        seen: set[int] = set()
        storages: list[torch.UntypedStorage] = []
        for tensor in tensors:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            storage = local.untyped_storage()
            if storage.device != self._device or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            storages.append(storage)
        return storages

    def _host_buffer(self, index: int, nbytes: int) -> torch.Tensor:
        if index < len(self._hosts) and self._hosts[index].numel() == nbytes:
            return self._hosts[index]
        pin = self._device.type == "cuda"
        buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
        if index < len(self._hosts):
            self._hosts[index] = buffer
        else:
            self._hosts.append(buffer)
        return buffer

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copies the distinct storages of ``tensors`` to the host and frees them; returns the bytes.

        Raises:
            RuntimeError: If already offloaded.
        """
        if self._offloaded:
            raise RuntimeError("the tensors are offloaded already; call restore() first")
        storages = self._storages(tensors)
        offloaded: list[_Offloaded] = []
        for index, storage in enumerate(storages):
            host = self._host_buffer(index, storage.nbytes())
            host.copy_(_device_view(storage), non_blocking=True)
            offloaded.append(_Offloaded(storage=storage, host=host))
        del self._hosts[len(storages) :]
        # The copies must land before the device memory is released.
        _synchronize(self._device)
        for item in offloaded:
            item.storage.resize_(0)
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self._offloaded = offloaded
        return sum(item.host.numel() for item in offloaded)

    def restore(self) -> int:
        """Re-allocates every offloaded storage and copies its bytes back; returns the bytes."""
        for item in self._offloaded:
            item.storage.resize_(item.host.numel())
            _device_view(item.storage).copy_(item.host, non_blocking=True)
        _synchronize(self._device)
        moved = sum(item.host.numel() for item in self._offloaded)
        self._offloaded = []
        return moved


def training_state_tensors(
    modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer
) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state tensors of a trainer's stages."""
    tensors: list[torch.Tensor] = []
    for module in modules:
        for parameter in module.parameters():
            tensors.append(parameter)
            if parameter.grad is not None:
                tensors.append(parameter.grad)
        tensors.extend(module.buffers())
    for state in optimizer.state.values():
        tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    return tensors


class TrainerSleeper:
    """A trainer's ``sleep`` / ``wake``: its training state off the device and back, with events.

    Args:
        device: The trainer's device.
        tensors: Lists the tensors to move at the moment of sleeping (optimizer state appears
            lazily at the first step, so it is read each time).
        publish: Delivers the events (the trainer's event bus).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        tensors: Callable[[], list[torch.Tensor]],
        publish: Callable[[object], None],
    ) -> None:
        self._offloader = TensorOffloader(device)
        self._tensors = tensors
        self._publish = publish

    @property
    def is_asleep(self) -> bool:
        """Whether the state is on the host."""
        return self._offloader.is_offloaded

    def sleep(self, step: int) -> None:
        """Moves the state to the host and empties the allocator's cache (no-op when asleep)."""
        if self.is_asleep:
            return
        self._publish(SleepStarted(step=step))
        started = time.perf_counter()
        moved = self._offloader.offload(self._tensors())
        self._publish(SleepFinished(step=step, bytes_moved=moved, seconds=time.perf_counter() - started))

    def wake(self, step: int) -> None:
        """Brings the state back, bit-exact (no-op when awake)."""
        if not self.is_asleep:
            return
        self._publish(WakeStarted(step=step))
        started = time.perf_counter()
        moved = self._offloader.restore()
        self._publish(WakeFinished(step=step, bytes_moved=moved, seconds=time.perf_counter() - started))
