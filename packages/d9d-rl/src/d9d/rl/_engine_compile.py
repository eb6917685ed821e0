"""``torch.compile`` of one of the engine's model functions, as its own region where torch allows."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar, cast

import torch

from d9d.rl._engine_config import CompileBackend

F = TypeVar("F", bound=Callable[..., torch.Tensor])


def compile_engine_region(
    function: F, *, recompile_limit: int, backend: CompileBackend, dynamic: bool | None = None
) -> F:
    """``function`` through ``torch.compile`` with ``fullgraph`` (one graph).

    On torch 2.15 and newer the region is the engine's own (``isolate_recompiles``): other
    engines' graphs do not count against ``recompile_limit``, past which Dynamo raises
    (``fullgraph``) instead of running eagerly. Older torch has neither argument: the engines of a
    process share Dynamo's cache of ``function`` and its process-wide limit (8).

    Args:
        function: The model function.
        recompile_limit: Graphs the region may hold.
        backend: ``torch.compile``'s backend (``EmbeddedEngineConfig.compile_backend``).
        dynamic: ``torch.compile``'s ``dynamic`` (None: sizes become dynamic when they change or
            are marked so).
    """
    # torch.compile's typed overloads omit recompile_limit and isolate_recompiles (its definition has them)
    compile_region = cast(Callable[..., F], torch.compile)
    if "recompile_limit" not in inspect.signature(torch.compile).parameters:
        return compile_region(function, fullgraph=True, dynamic=dynamic, backend=backend)
    return compile_region(
        function,
        fullgraph=True,
        dynamic=dynamic,
        backend=backend,
        recompile_limit=recompile_limit,
        isolate_recompiles=True,
    )
