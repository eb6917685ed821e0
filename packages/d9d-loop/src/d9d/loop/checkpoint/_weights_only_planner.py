"""A DCP load planner that reads a checkpoint's non-tensor values with ``torch.load(weights_only=True)``.

DCP stores every value of a state dict that is not a tensor (an optimizer's ``lr``, d9d's train
state) as ``torch.save`` bytes, and its default planner reads them back with
``weights_only=False``: full pickle, which runs whatever code a crafted checkpoint holds. This
planner reads them with the restricted unpickler (tensors and plain containers only), so such a
value is refused instead of run. DCP's own ``.metadata`` is still a pickle read by torch: a
checkpoint stays trusted input.
"""

from __future__ import annotations

import io
from collections.abc import MutableMapping, Sequence
from typing import cast

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem


class UnsafeCheckpointValueError(RuntimeError):
    """A checkpoint's non-tensor value would need full pickle (code execution) to load; names it."""


def _first_reason(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if "WeightsUnpickler error" in line]
    if not lines:
        return str(error)
    # torch goes on to suggest allowlisting the global: not advice for an untrusted file
    return lines[0].removeprefix("WeightsUnpickler error:").split(" Please use")[0].strip()


def load_weights_only(value: io.BytesIO, *, what: str) -> object:
    """``torch.load(value, weights_only=True)``, its refusal named after ``what`` in one line.

    Raises:
        UnsafeCheckpointValueError: If ``value`` holds anything but tensors and plain values.
    """
    try:
        return cast(object, torch.load(value, weights_only=True))
    except Exception as e:  # torch raises UnpicklingError, or RuntimeError wrapping it
        raise UnsafeCheckpointValueError(
            f"{what} holds a value that loads only with full pickle, which can run code, and is refused "
            f"(torch.load weights_only=True): {_first_reason(e)}"
        ) from e


def _set(root: MutableMapping[str, object], path: Sequence[str | int], value: object) -> None:
    # The containers on the path exist: DCP flattened this very state dict to find the path.
    container: object = root
    for key in path[:-1]:
        container = (
            cast(MutableMapping[object, object], container)[key]
            if isinstance(container, MutableMapping)
            else cast(list[object], container)[cast(int, key)]
        )
    if isinstance(container, MutableMapping):
        cast(MutableMapping[object, object], container)[path[-1]] = value
    else:
        cast(list[object], container)[cast(int, path[-1])] = value


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values load with ``weights_only=True``.

    Pass it as ``dcp.load(..., planner=WeightsOnlyLoadPlanner())``; tensors load as before.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Restores one non-tensor value; refuses one that needs full pickle.

        Raises:
            UnsafeCheckpointValueError: Naming the value's key.
        """
        fqn = read_item.dest_index.fqn
        loaded = load_weights_only(value, what=f"checkpoint value '{fqn}'")
        if self.flatten_state_dict:
            _set(cast(MutableMapping[str, object], self.original_state_dict), self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
