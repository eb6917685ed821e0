"""Activation checkpointing of chosen submodules: full, or selective by op type.

A checkpointed module keeps only its inputs from forward and runs forward again in backward
(full), or keeps the outputs of chosen ops (matrix multiplies, attention) and reruns the rest
(selective). Parameter names, state dicts and hooks stay as they are: the module's class is
swapped for a subclass whose ``forward`` runs under ``torch.utils.checkpoint``, as FSDP2's
``fully_shard`` does, so it composes with FSDP, TP and pipeline stages in either order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

_aten = torch.ops.aten


def _default_saved_ops() -> frozenset[Any]:
    # The expensive ops whose outputs are worth their memory (torchtitan's choice).
    return frozenset(
        {
            _aten.mm.default,
            _aten.addmm.default,
            _aten.bmm.default,
            _aten._scaled_dot_product_efficient_attention.default,
            _aten._scaled_dot_product_flash_attention.default,
            _aten._scaled_dot_product_cudnn_attention.default,
        }
    )


@dataclass(kw_only=True, frozen=True)
class FullCheckpointing:
    """Keep only each checkpointed module's inputs; rerun its whole forward in backward."""


@dataclass(kw_only=True, frozen=True)
class SelectiveCheckpointing:
    """Keep the outputs of ``saved_ops`` (aten overloads); rerun every other op in backward.

    Attributes:
        saved_ops: The ops whose outputs are saved (by default matrix multiplies and attention).
    """

    saved_ops: frozenset[Any] = field(default_factory=_default_saved_ops)


CheckpointingPolicy = FullCheckpointing | SelectiveCheckpointing
ModuleSelector = Callable[[str, nn.Module], bool] | Collection[str]


def checkpoint_modules(
    model: nn.Module, modules: ModuleSelector, policy: CheckpointingPolicy | None = None
) -> list[str]:
    """Checkpoints the activations of the chosen submodules of ``model`` in place.

    Args:
        model: The model (or one pipeline stage).
        modules: Qualified submodule names (``["layers.0", "layers.1"]``), or a predicate of
            (name, module) (``lambda name, m: isinstance(m, Block)``). A chosen module inside
            another chosen one is left alone (the outer one covers it).
        policy: ``FullCheckpointing()`` (the default) or ``SelectiveCheckpointing(...)``.

    Returns:
        The names of the modules checkpointed.

    Raises:
        ValueError: If a given name is not a submodule of ``model``, or a module is already
            checkpointed.
    """
    policy = policy or FullCheckpointing()
    named = dict(cast(Iterator[tuple[str, nn.Module]], model.named_modules()))
    if callable(modules):
        chosen = [name for name, module in named.items() if modules(name, module)]
    else:
        missing = sorted(set(modules) - named.keys())
        if missing:
            raise ValueError(f"checkpoint_modules: {missing} are not submodules of {type(model).__name__}")
        chosen = [name for name in named if name in modules]
    outermost = [n for n in chosen if not any(o != n and (o == "" or n.startswith(f"{o}.")) for o in chosen)]
    for name in outermost:
        _checkpoint_module(named[name], name, policy)
    return outermost


class _Checkpointed:
    """Marks a module class made by ``checkpoint_modules``."""

    checkpointing_policy: CheckpointingPolicy


def _checkpoint_module(module: nn.Module, name: str, policy: CheckpointingPolicy) -> None:
    if isinstance(module, _Checkpointed):
        raise ValueError(f"checkpoint_modules: module {name!r} is already checkpointed")
    original = type(module)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        run = partial(original.forward, self)
        context_fn = _context_fn(policy)
        return torch_checkpoint.checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.__class__ = type(
        f"Checkpointed{original.__name__}",
        (_Checkpointed, original),
        {"forward": forward, "checkpointing_policy": policy},
    )


def _context_fn(policy: CheckpointingPolicy) -> Callable[[], Any]:
    match policy:
        case FullCheckpointing():
            return _noop_contexts
        case SelectiveCheckpointing(saved_ops=saved_ops):
            return partial(
                torch_checkpoint.create_selective_checkpoint_contexts, partial(_policy_of_op, saved_ops)
            )


def _noop_contexts() -> Any:
    return torch_checkpoint.noop_context_fn()


def _policy_of_op(
    saved_ops: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if op in saved_ops else CheckpointPolicy.PREFER_RECOMPUTE
