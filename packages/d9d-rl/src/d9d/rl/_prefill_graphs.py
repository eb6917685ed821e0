"""One fresh prompt's prefill at a static width, and its CUDA graphs: one per width bucket.

Rows finish one at a time, so most admissions prefill one prompt. Eagerly that prefill is a few
hundred small kernels that the host launches one by one; a replayed graph launches them at once.
"""

from __future__ import annotations

import torch

from d9d.hf import DecoderCausalLM
from d9d.rl._decode_graphs import warm_up_on_side_stream
from d9d.rl._kv_cache import PagedInputs, PagedKVCache, PrefillFunction, run_paged_logits
from d9d.rl._pinned_copy import to_device

GRAPHED_MAX_WIDTH = 2048
"""Widest bucket: a longer prompt's prefill is mostly device work, and runs eagerly."""

_MIN_WIDTH = 16


def width_bucket(tokens: int) -> int:
    """The static width a prompt of ``tokens`` tokens runs at: a power of two, at least 16."""
    return max(_MIN_WIDTH, 1 << (tokens - 1).bit_length())


class StaticPrefill:
    """The buffers of one prompt's prefill, padded to its width bucket, and the forward over them.

    A prompt of ``n`` tokens runs at ``width_bucket(n)``: its tokens, then ``pad_token_id``; the
    padding's keys and values go to the pool's scratch block (``paged_logits``) and its queries are
    masked, so the logits and the row's cached keys and values are those of ``forward_paged`` on
    the prompt alone. ``load`` copies a prompt into the buffers (one pinned host-to-device copy);
    ``forward`` reads only the buffers, so a CUDA graph of each width replays it.

    Args:
        model: The whole model.
        cache: The paged pool (its last block is scratch).
        pad_token_id: Input token of the padding.
        compiled: ``compile_paged_logits``'s function, or None: eager.
    """

    def __init__(
        self,
        model: DecoderCausalLM,
        cache: PagedKVCache,
        *,
        pad_token_id: int,
        compiled: PrefillFunction | None = None,
    ) -> None:
        device = cache.keys[0].device
        self._model = model
        self._cache = cache
        self._pad = pad_token_id
        self._compiled = compiled
        columns = self._columns(GRAPHED_MAX_WIDTH)
        self._ids = torch.full((1, GRAPHED_MAX_WIDTH), pad_token_id, dtype=torch.int64, device=device)
        self._table = torch.zeros((1, columns), dtype=torch.int64, device=device)
        self._starts = torch.zeros((1, 1), dtype=torch.int64, device=device)
        self._counts = torch.ones((1, 1), dtype=torch.int64, device=device)
        self._positions = torch.arange(GRAPHED_MAX_WIDTH, device=device)

    def _columns(self, width: int) -> int:
        # at least two columns, as PagedInputs pads them (a size of 1 is specialized when compiled)
        return max(2, -(-width // self._cache.page_size))

    def load(self, tokens: list[int], blocks: list[int]) -> int:
        """Copies one fresh prompt (nothing of it cached) and its blocks into the buffers.

        Returns:
            The width bucket to run ``forward`` at.

        Raises:
            ValueError: If the prompt is longer than ``GRAPHED_MAX_WIDTH`` or its blocks do not fit it.
        """
        width = width_bucket(len(tokens))
        columns = self._columns(width)
        if (
            width > GRAPHED_MAX_WIDTH
            or len(blocks) * self._cache.page_size < len(tokens)
            or len(blocks) > columns
        ):
            raise ValueError(
                f"a static prefill takes one prompt of at most {GRAPHED_MAX_WIDTH} tokens with its blocks; "
                f"got {len(tokens)} tokens and {len(blocks)} blocks of {self._cache.page_size}"
            )
        packed = [
            *tokens,
            *[self._pad] * (width - len(tokens)),
            *blocks,
            *[0] * (columns - len(blocks)),
            len(tokens),
        ]
        staged = to_device(packed, self._ids.device)
        self._ids[0, :width].copy_(staged[:width])
        self._table[0, :columns].copy_(staged[width : width + columns])
        self._counts.view(1).copy_(staged[-1:])
        return width

    def forward(self, width: int) -> torch.Tensor:
        """``(1, vocab)`` float32 logits at the loaded prompt's last token, its keys and values cached."""
        slots = self._positions[:width]
        inputs = PagedInputs(
            input_ids=self._ids[:, :width],
            table=self._table[:, : self._columns(width)],
            starts=self._starts,
            counts=self._counts,
            new_flat=slots,  # one row: a position's flat index is the position
            slots=slots,
        )
        return run_paged_logits(self._model, self._cache, inputs, self._compiled)


class GraphedPrefill:
    """Runs ``prefill.forward(width)`` by replaying a CUDA graph captured for ``width``.

    As ``GraphedDecodeStep``: the first prefill of a width runs eagerly on a side stream (lazy
    initialization, compilation), then its graph is captured into a memory pool shared by the
    widths' graphs (not the decode step's: a step that decodes and prefills holds both outputs).
    The graphs read the buffers, the pool and the weights at their captured addresses.

    Args:
        prefill: The static prefill, on a CUDA device.
    """

    def __init__(self, prefill: StaticPrefill) -> None:
        self._prefill = prefill
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def has(self, width: int) -> bool:
        """Whether ``width`` has a captured graph (its next prefill replays it)."""
        return width in self._graphs

    def prefill(self, tokens: list[int], blocks: list[int]) -> torch.Tensor:
        """``(1, vocab)`` float32 logits of one fresh prompt, valid until the next call."""
        width = self._prefill.load(tokens, blocks)
        found = self._graphs.get(width)
        if found is not None:
            graph, logits = found
            graph.replay()
            return logits
        logits = warm_up_on_side_stream(lambda: self._prefill.forward(width))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                captured = self._prefill.forward(width)
        except RuntimeError as error:
            raise RuntimeError(
                f"capturing the engine's prefill of one prompt ({width} tokens wide) in a CUDA graph "
                f"failed: {error}. Some layer of this model reads a tensor on the host or changes shape "
                "by its values; run the engine without it: EmbeddedEngineConfig(prefill_graphs=False)"
            ) from error
        self._graphs[width] = (graph, captured)
        return logits
