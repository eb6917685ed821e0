"""How many tokens one chunk of the fused linear cross-entropy's logits holds (no Triton needed)."""

from __future__ import annotations

# A chunk's logits take about _CHUNK_BYTES, or a quarter of the tokens when that is more (at most
# _LARGEST_CHUNK_BYTES): each chunk's weight-gradient product reads and writes the whole (V, H)
# gradient, which at 22 chunks of 745 tokens (seq 4096 x 4, vocab 151936) cost 12% of the head, and
# the three products run 6-12% faster at 4096 tokens than at 2048 (H100, hidden 1152, vocab 262144).
_CHUNK_BYTES = 1 << 28
_LARGEST_CHUNK_BYTES = 1 << 31
_MOST_CHUNKS = 4
_ALIGN = 256


def linear_cross_entropy_chunk_tokens(tokens: int, vocab: int, element_size: int) -> int:
    """Tokens per chunk that ``linear_cross_entropy``'s Triton path uses when no ``chunk_size`` is given.

    As many tokens as keep one chunk's logits near 256 MiB, or a quarter of the tokens when that is
    more, up to 2 GiB of logits; in multiples of 256 tokens, and never more than ``tokens``.

    Args:
        tokens: Tokens of the call (rows of ``hidden``).
        vocab: Rows of the head's weight on this device.
        element_size: Bytes per logit (the inputs' dtype).

    Returns:
        Tokens per chunk, between 1 and ``max(1, tokens)``.
    """
    row = max(1, vocab * element_size)
    by_bytes = max(1, _CHUNK_BYTES // row)
    if by_bytes >= _ALIGN:
        by_bytes -= by_bytes % _ALIGN
    quarter = -(-tokens // _MOST_CHUNKS)
    largest = max(by_bytes, _LARGEST_CHUNK_BYTES // row // _ALIGN * _ALIGN)
    return max(1, min(tokens, max(by_bytes, min(-(-quarter // _ALIGN) * _ALIGN, largest))))
