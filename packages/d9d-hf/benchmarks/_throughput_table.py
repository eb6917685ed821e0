"""The throughput benchmark's table: rows over rounds, ratios against the peers, and the issues' goals.

A round maps a row's name to its record (``tokens_per_s``, ``peak_memory_gib``); a row that did
not run (a peer not installed) has a reason instead. Every ratio is taken within a round and
printed as the median over the rounds with its range.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from _stats import spread

PEERS = ("titan", "titan_amp", "hf_compile")
"""The rows that the table gives ratios against, where they ran."""


@dataclass(frozen=True, kw_only=True)
class Goal:
    """An issue's speed goal for a shape: d9d's tok/s at least ``ratio`` x the peer's, at no more memory.

    Attributes:
        issue: Where the goal is set.
        peer: The implementation compared with (its row name without suffixes).
        ratio: The tok/s ratio to reach.
    """

    issue: str
    peer: str
    ratio: float


GOALS: dict[str, Goal] = {
    "gemma3_1b": Goal(issue="issue 45", peer="hf_compile", ratio=1.5),
    "mistral7b": Goal(issue="issue 45", peer="hf_compile", ratio=1.5),
    "deepseek16b": Goal(issue="issue 46", peer="titan", ratio=1.2),
    "gptoss20b": Goal(issue="issue 46", peer="titan", ratio=1.2),
}
"""Shapes whose issue sets a goal. For torchtitan the peer row of the same precision is taken:
``titan`` (all bf16) against d9d's bf16 state, ``titan_amp`` against its float32 master weights."""


def _ratios(rounds: list[dict[str, Any]], name: str, peer: str, field: str) -> list[float]:
    paired = [r for r in rounds if isinstance(r.get(name), dict) and isinstance(r.get(peer), dict)]
    return [r[name][field] / r[peer][field] for r in paired]


def table_lines(
    names: list[str], rounds: list[dict[str, Any]], *, flops_per_token: float, peak_tflops: float
) -> list[str]:
    """The Markdown table: one row per name, ratio columns for each peer that ran."""
    ran = {name for r in rounds for name, record in r.items() if isinstance(record, dict)}
    peers = [peer for peer in PEERS if peer in ran]
    header = "| implementation | k tok/s | MFU % | peak GiB |"
    header += "".join(f" tok/s vs {peer} | memory vs {peer} |" for peer in peers)
    lines = [header, "|---" * (4 + 2 * len(peers)) + "|"]
    for name in names:
        records = [r[name] for r in rounds if isinstance(r.get(name), dict)]
        if not records:
            reasons = {r[name] for r in rounds if isinstance(r.get(name), str)}
            if reasons:
                lines.append(f"| {name} | not run: {'; '.join(sorted(reasons))} |")
            continue
        speeds = [record["tokens_per_s"] / 1e3 for record in records]
        mfus = [100 * record["tokens_per_s"] * flops_per_token / (peak_tflops * 1e12) for record in records]
        memory = [record["peak_memory_gib"] for record in records]
        line = f"| {name} | {spread(speeds)} | {spread(mfus)} | {spread(memory)} |"
        for peer in peers:
            line += f" {spread(_ratios(rounds, name, peer, 'tokens_per_s'))} |"
            line += f" {spread(_ratios(rounds, name, peer, 'peak_memory_gib'))} |"
        lines.append(line)
    return lines


def goal_lines(goal: Goal, names: list[str], rounds: list[dict[str, Any]], *, d9d_state: str) -> list[str]:
    """Each d9d row against the goal's peer of the same precision: the median ratios and whether it is met."""
    peer = goal.peer
    if peer == "titan" and d9d_state == "float32":
        peer = "titan_amp"  # float32 parameters and AdamW state on both sides
    lines: list[str] = []
    for name in (n for n in names if n.startswith("d9d")):
        speed = _ratios(rounds, name, peer, "tokens_per_s")
        memory = _ratios(rounds, name, peer, "peak_memory_gib")
        if not speed:
            lines.append(
                f"goal ({goal.issue}): {name} / {peer} >= {goal.ratio}x: not measured ({peer} did not run)"
            )
            continue
        met = statistics.median(speed) >= goal.ratio and statistics.median(memory) <= 1.0
        lines.append(
            f"goal ({goal.issue}): {name} / {peer} tok/s {spread(speed)} >= {goal.ratio}x at memory "
            f"{spread(memory)} <= 1: {'met' if met else 'not met'}"
        )
    return lines
