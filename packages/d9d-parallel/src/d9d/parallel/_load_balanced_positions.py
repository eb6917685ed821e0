"""Which tokens of a sequence each context-parallel rank holds (load-balanced for causal masks).

The sequence is cut into ``2 * cp`` equal chunks and rank ``r`` takes chunks ``r`` and
``2 * cp - 1 - r``: one early and one late chunk, so with a causal mask every rank does the
same attention work.
"""

from __future__ import annotations

import torch


def check_sequence_length(length: int, cp: int, *, what: str) -> int:
    """Returns the chunk length, or raises naming ``what`` if ``length`` does not split evenly."""
    if length % (2 * cp) != 0:
        raise ValueError(
            f"{what}: sequence length {length} is not divisible by 2 * cp = {2 * cp} "
            f"(context parallelism over {cp} ranks cuts it into {2 * cp} equal chunks)"
        )
    return length // (2 * cp)


def local_positions(length: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions (in order) of the tokens rank ``rank`` holds of a ``length``-long sequence."""
    chunk = check_sequence_length(length, cp, what="context parallelism")
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])
