"""What a checkpoint holds, as DCP ``Stateful`` objects."""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler

from d9d.loop.checkpoint._weights_only_planner import UnsafeCheckpointValueError, load_weights_only


def _container(stages: Sequence[nn.Module]) -> nn.Module:
    return stages[0] if len(stages) == 1 else nn.ModuleList(stages)


class ModelState:
    """The parameters and buffers of all local stages (sharded tensors stay sharded).

    Keys are the stages' own names, so a checkpoint reshards across data/tensor-parallel layouts.
    With ``trainable_only`` (LoRA) it holds only the parameters that train (the adapters and the
    ``peft.trainable`` matches): the frozen base weights are not saved, and on resume they come
    from where they came at the start (``trainer.initialization.source``, the provider, or the
    seeded initialization).
    """

    def __init__(self, stages: Sequence[nn.Module], *, trainable_only: bool = False) -> None:
        self._stages = stages
        self._trainable_only = trainable_only

    def _own(self, stage: nn.Module) -> dict[str, Any]:
        state = get_model_state_dict(stage)
        if not self._trainable_only:
            return state
        trainable = {name for name, p in stage.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trainable}

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for stage in self._stages:
            for key, value in self._own(stage).items():
                if key in merged:
                    raise ValueError(
                        f"two local pipeline stages both have a tensor named '{key}'; give layers "
                        f"stage-independent names (e.g. their global layer index)"
                    )
                merged[key] = value
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for stage in self._stages:
            own = {k: state_dict[k] for k in self._own(stage)}
            # every key this state asked for is present (DCP loads exactly those); a partial state
            # (trainable_only) leaves the frozen weights as they are
            set_model_state_dict(stage, own, options=StateDictOptions(strict=not self._trainable_only))


# Keys per parameter ("param_groups.<name>.lr"), not one param_groups list per rank: pipeline
# ranks hold different parameters, and DCP would keep only one rank's copy of a shared key.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizerState:
    """The optimizer's state over all local stages, keyed by parameter name.

    With several stages per rank the names carry the stage's position on the rank, so such a
    checkpoint resumes on the same pipeline layout only.
    """

    def __init__(self, stages: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        self._module = _container(stages)
        self._optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self._module, self._optimizer, options=_FLAT)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self._module, self._optimizer, state_dict, options=_FLAT)


# How d9d stores a non-tensor state: ``torch.save`` bytes of tensors and plain containers, read
# back with ``weights_only=True``. d9d 0.25 and older stored ``pickle.dumps`` bytes under "pickled".
_SAVED = "torch_save"
_PICKLED = "pickled"
_PLAIN = "tensors and plain Python values (dict, list, tuple, set, str, int, float, bool, None)"


class PickledTrainStateError(ValueError):
    """A checkpoint stores d9d's train state as a Python pickle (an older d9d wrote it); names it."""


def refuse_pickled_state(path: Path, saved: Iterable[str], wanted: Iterable[str]) -> None:
    """Refuses a checkpoint whose train state is a pickle, before anything loads.

    Args:
        path: The checkpoint, for the message.
        saved: The keys its DCP metadata lists (``trainer.pickled``, ...).
        wanted: The top-level keys the run restores.

    Raises:
        PickledTrainStateError: Naming the checkpoint, the pickled keys and how to go on.
    """
    wanted_keys = set(wanted)
    pickled = sorted(
        key for key in saved if key.endswith(f".{_PICKLED}") and key.split(".", 1)[0] in wanted_keys
    )
    if pickled:
        raise PickledTrainStateError(
            f"checkpoint {path} stores its train state ({', '.join(pickled)}) as a Python pickle "
            f"(written by d9d-loop 0.25 or older); unpickling can run code, so d9d does not resume "
            f"from it. Its weights load without pickle: `d9d export <config> {path} <dir>` and start a "
            f"new run from the export (trainer.initialization.source), or move {path} out of the "
            f"checkpoint directory to resume from another checkpoint or start over"
        )


def _save_bytes(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads_weights_only(payload: bytes, *, what: str) -> object:
    return load_weights_only(io.BytesIO(payload), what=what)


def _to_saved(state: dict[str, Any], *, what: str) -> dict[str, Any]:
    """``state`` as ``torch.save`` bytes, checked to load with ``weights_only=True`` now, not at resume.

    Raises:
        TypeError: Naming the top-level key whose value would need full pickle.
    """
    payload = _save_bytes(state)
    try:
        _loads_weights_only(payload, what=what)
    except UnsafeCheckpointValueError:
        for key, value in state.items():
            try:
                _loads_weights_only(_save_bytes(value), what=f"{what} '{key}'")
            except UnsafeCheckpointValueError as e:
                raise TypeError(f"{e}; a checkpoint's state must hold only {_PLAIN}") from e
        raise
    return {_SAVED: payload}


def _from_saved(state_dict: dict[str, Any], *, what: str) -> dict[str, Any]:
    payload: object = state_dict.get(_SAVED)
    if not isinstance(payload, bytes):
        raise ValueError(f"{what} in the checkpoint holds {sorted(state_dict)}, not '{_SAVED}' bytes")
    loaded = _loads_weights_only(payload, what=what)
    if not isinstance(loaded, dict):
        raise ValueError(f"{what} in the checkpoint is a {type(loaded).__name__}, not a dict")
    return cast(dict[str, Any], loaded)


class RandomState:
    """This rank's random generators (Python, numpy, torch CPU and CUDA), stored under its rank.

    Stored as tensors and plain values (numpy's key as a list of ints), so they load with
    ``torch.load(weights_only=True)``.
    """

    def state_dict(self) -> dict[str, Any]:
        states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            kind, key, pos, has_gauss, cached_gaussian = cast(
                tuple[str, "np.ndarray[Any, Any]", int, int, float], np.random.get_state(legacy=True)
            )
            states["numpy"] = {
                "kind": str(kind),
                "key": cast(list[int], key.astype(np.int64).tolist()),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            }
        except ImportError:
            pass
        return _to_saved(states, what="random state")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = _from_saved(state_dict, what="random state")
        random.setstate(states["python"])
        torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])
        if "numpy" in states:
            import numpy as np

            saved = cast(dict[str, Any], states["numpy"])
            np.random.set_state(
                (
                    str(saved["kind"]),
                    np.array(saved["key"], dtype=np.uint32),
                    int(saved["pos"]),
                    int(saved["has_gauss"]),
                    float(saved["cached_gaussian"]),
                )
            )


class ObjectState:
    """Plain state behind getter/setter callables (step, data position, scheduler, task, tracker).

    The getter's dict must hold only tensors and plain Python values: it is stored as
    ``torch.save`` bytes and read back with ``weights_only=True`` (no pickle); a value that would
    need pickle (a numpy scalar, a custom object) is refused when the checkpoint is saved, naming
    its top-level key.
    """

    def __init__(self, get: Callable[[], dict[str, Any]], set_: Callable[[dict[str, Any]], None]) -> None:
        self._get = get
        self._set = set_

    def state_dict(self) -> dict[str, Any]:
        return _to_saved(self._get(), what="the train state")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._set(_from_saved(state_dict, what="the train state"))


def scheduler_state(scheduler: LRScheduler) -> dict[str, Any]:
    """The scheduler's state without callables (LambdaLR's lambdas are rebuilt from config)."""
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
