"""What a checkpoint holds, as DCP ``Stateful`` objects."""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable, Sequence
from typing import Any

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


class RandomState:
    """This rank's random generators (Python, numpy, torch CPU and CUDA), stored under its rank."""

    def state_dict(self) -> dict[str, Any]:
        states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            states["numpy"] = np.random.get_state()
        except ImportError:
            pass
        return {"pickled": pickle.dumps(states)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states: dict[str, Any] = pickle.loads(state_dict["pickled"])
        random.setstate(states["python"])
        torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])
        if "numpy" in states:
            import numpy as np

            np.random.set_state(states["numpy"])


class ObjectState:
    """Plain state behind getter/setter callables (step, data position, scheduler, task, tracker)."""

    def __init__(self, get: Callable[[], dict[str, Any]], set_: Callable[[dict[str, Any]], None]) -> None:
        self._get = get
        self._set = set_

    def state_dict(self) -> dict[str, Any]:
        return {"pickled": pickle.dumps(self._get())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._set(pickle.loads(state_dict["pickled"]))


def scheduler_state(scheduler: LRScheduler) -> dict[str, Any]:
    """The scheduler's state without callables (LambdaLR's lambdas are rebuilt from config)."""
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
