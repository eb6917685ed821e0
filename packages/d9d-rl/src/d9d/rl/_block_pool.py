"""A pool of fixed-size KV-cache blocks handed to rows as their tokens grow."""

from __future__ import annotations


class BlockPool:
    """The free list of ``num_blocks`` block indices; rows take blocks and give them back.

    Args:
        num_blocks: Blocks in the pool.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._taken: set[int] = set()
        self.peak_taken = 0

    @property
    def free_count(self) -> int:
        """Blocks not held by any row."""
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """``count`` free blocks, now held by the caller.

        Raises:
            RuntimeError: If fewer than ``count`` blocks are free.
        """
        if count > len(self._free):
            raise RuntimeError(f"the block pool has {len(self._free)} free blocks, {count} were asked for")
        blocks = [self._free.pop() for _ in range(count)]
        self._taken.update(blocks)
        self.peak_taken = max(self.peak_taken, len(self._taken))
        return blocks

    def give_back(self, blocks: list[int]) -> None:
        """Returns blocks taken from this pool.

        Raises:
            ValueError: If a block is not currently taken (given back twice, or foreign).
        """
        for block in blocks:
            if block not in self._taken:
                raise ValueError(f"block {block} is not taken from this pool")
            self._taken.remove(block)
            self._free.append(block)
