"""CUDA graphs over the static decode step: one captured graph per batch-size bucket, replayed."""

from __future__ import annotations

from collections.abc import Callable

import torch

from d9d.rl._decode_step import StaticDecodeStep


def warm_up_on_side_stream(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run()`` on a side stream ordered after the current one's work (as a capture's warm-up
    must run: lazy initialization, compilation, autotuning), then the current stream waits for it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = run()
    torch.cuda.current_stream().wait_stream(side)
    return out


class GraphedDecodeStep:
    """Runs ``step.forward(rows)`` by replaying a CUDA graph captured for ``rows``.

    The first step of a bucket runs eagerly on a side stream (the warm-up: lazy initialization,
    Triton compilation, ``torch.compile``'s compilation of a compiled step; its logits are that
    step's result), then the bucket's graph is captured
    (capture records, it does not run) into a memory pool shared by every bucket's graph. Later
    steps of the bucket replay it. The graphs read the step's buffers, the pool and the weights at
    the addresses they had when captured: drop this object when any of them is reallocated (the
    engine does so on ``sleep``). Updating the weights in place (``copy_``) keeps them valid.

    Args:
        step: The static decode step, on a CUDA device.
    """

    def __init__(self, step: StaticDecodeStep) -> None:
        self._step = step
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def captured(self) -> list[int]:
        """The buckets with a captured graph."""
        return sorted(self._graphs)

    def has(self, rows: int) -> bool:
        """Whether ``rows``'s bucket has a captured graph (its next step replays it)."""
        return rows in self._graphs

    def forward(self, rows: int) -> torch.Tensor:
        """``(rows, vocab)`` float32 logits, valid until the next call."""
        found = self._graphs.get(rows)
        if found is not None:
            graph, logits = found
            graph.replay()
            return logits
        logits = self._warm_up(rows)
        self._capture(rows)
        return logits

    def _warm_up(self, rows: int) -> torch.Tensor:
        return warm_up_on_side_stream(lambda: self._step.forward(rows))

    def _capture(self, rows: int) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (a data loader's pinning thread) do not
            # invalidate the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._step.forward(rows)
        except RuntimeError as error:
            compiled = (
                "; the step is compiled (compile_decode): a compilation or autotuning the warm-up did "
                "not run fails a capture too, try EmbeddedEngineConfig(compile_decode=False) first"
                if self._step.compiled
                else ""
            )
            raise RuntimeError(
                f"capturing the engine's decode step ({rows} rows) in a CUDA graph failed: {error}. "
                "Some layer of this model reads a tensor on the host or changes shape by its values; "
                f"run the engine without graphs: EmbeddedEngineConfig(cuda_graphs=False){compiled}"
            ) from error
        self._graphs[rows] = (graph, logits)
