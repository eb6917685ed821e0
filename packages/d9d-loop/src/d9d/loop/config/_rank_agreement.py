"""Every rank runs the same job: the mesh and trainer settings are compared across ranks at start."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

import torch.distributed as dist
from pydantic import BaseModel
from torch.distributed import ProcessGroup

_SHOWN = 3
"""How many differing fields the error spells out."""


class RankDisagreementError(ValueError):
    """Ranks were started with different settings; the message names the fields and the ranks."""


def flat_settings(sections: Mapping[str, BaseModel]) -> dict[str, str]:
    """``section.field.subfield`` -> the value as JSON, for every leaf of every section."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in cast(dict[str, Any], value).items():
                walk(f"{prefix}.{key}", item)
        else:
            flat[prefix] = json.dumps(value, sort_keys=True, default=str)

    for name, section in sections.items():
        walk(name, section.model_dump(mode="json"))
    return flat


def describe_disagreement(per_rank: list[dict[str, str]]) -> str | None:
    """Where the ranks' settings differ from rank 0's (None when they all agree)."""
    reference = per_rank[0]
    differing: dict[str, list[int]] = {}
    for rank, settings in enumerate(per_rank[1:], start=1):
        for key in sorted(reference.keys() | settings.keys()):
            if reference.get(key) != settings.get(key):
                differing.setdefault(key, []).append(rank)
    if not differing:
        return None
    lines: list[str] = []
    for key, ranks in list(differing.items())[:_SHOWN]:
        others = f" (and {len(ranks) - 1} more ranks)" if len(ranks) > 1 else ""
        ours, theirs = reference.get(key, "(unset)"), per_rank[ranks[0]].get(key, "(unset)")
        lines.append(f"{key}: rank 0 has {ours}, rank {ranks[0]} has {theirs}{others}")
    more = f"; and {len(differing) - _SHOWN} more fields" if len(differing) > _SHOWN else ""
    return (
        "the ranks were started with different settings (every rank must read the same config): "
        + "; ".join(lines)
        + more
    )


def check_ranks_agree(sections: Mapping[str, BaseModel], *, group: ProcessGroup | None = None) -> None:
    """Compares ``sections`` across the ranks of ``group``; one object gather, before any work.

    Raises:
        RankDisagreementError: On every rank, when some rank's settings differ from rank 0's,
            naming the first fields and the ranks.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    per_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, flat_settings(sections), group=group)
    problem = describe_disagreement(cast(list[dict[str, str]], per_rank))
    if problem is not None:
        raise RankDisagreementError(problem)
