"""DeepEP's communication buffer as d9d sees it: the calls used, a lazy import, one buffer per group."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup

_MAX_NVLINK_PEERS = 8  # DeepEP's intranode kernels connect at most 8 GPUs of one host
_BUILD_HINT = (
    "DeepEP is built from source for the installed torch and CUDA: run scripts/build-deepep.sh "
    "on the GPU machine (see docs/parallel.md, 'DeepEP dispatcher') and put its target folder on "
    "PYTHONPATH"
)


class DeepEPBuffer(Protocol):
    """The part of ``deep_ep.Buffer`` that ``DeepEPTokenDispatcher`` calls (DeepEP 1.x, intranode).

    ``dispatch`` sends each token once to every rank that holds one of its experts; the rank
    receives the token's ``topk_idx`` as local expert ids (-1 for experts elsewhere) and its
    weights (0 there). With a ``handle`` from an earlier call it repeats that exchange for new
    data. ``combine`` sends rows back along a handle and sums them per source token, without
    weights. The handle is opaque.
    """

    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, object]:
        """Returns tokens per rank, per RDMA rank (None intranode), per expert, the (T, ranks)
        token-in-rank mask and an event."""
        ...

    def dispatch(
        self,
        x: torch.Tensor,
        handle: object | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int] | None, object, object]:
        """Returns received rows, their local top-k ids and weights, rows per local expert, the
        handle (None for a cached call) and an event."""
        ...

    def combine(
        self, x: torch.Tensor, handle: object, topk_weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        """Returns per-token sums of ``x`` (and of ``topk_weights``) on the ranks the tokens came
        from, and an event."""
        ...


DeepEPBufferFactory = Callable[[ProcessGroup, torch.Tensor], DeepEPBuffer]
"""Makes a buffer over a group, large enough for rows like the given hidden states (collective)."""


def import_deep_ep() -> Any:
    """The ``deep_ep`` module, or an ImportError that says how to get it."""
    try:
        return importlib.import_module("deep_ep")
    except ImportError as error:
        raise ImportError(
            f"the 'deep_ep' dispatcher needs DeepEP ('import deep_ep': {error}). {_BUILD_HINT}"
        ) from error


def check_deep_ep_input(hidden: torch.Tensor) -> None:
    """Raises ValueError for hidden states DeepEP's kernels do not take."""
    if hidden.dtype != torch.bfloat16:
        raise ValueError(
            f"DeepEP's combine reduces bfloat16 rows only; the hidden states are {hidden.dtype} "
            "(use dispatcher='all_to_all' for other dtypes)"
        )
    if hidden.device.type != "cuda":
        raise ValueError(f"DeepEP dispatches CUDA tensors; the hidden states are on {hidden.device}")
    if hidden.shape[-1] * hidden.element_size() % 16 != 0:
        raise ValueError(
            f"DeepEP moves rows in 16-byte units; hidden size {hidden.shape[-1]} is not a multiple of 8"
        )


class DeepEPBuffers:
    """One DeepEP buffer per process group, shared by the dispatchers that are given this object.

    DeepEP's buffer holds NVLink-shared scratch memory (tens of MiB) and a workspace; one per
    MoE layer would waste it, so layers of one model share one object. A buffer is made on the
    first dispatch (making it is collective over the group) and made again, larger, when wider
    rows arrive; every rank of the group sees the same widths, so they agree.

    Args:
        factory: Makes a buffer; the default imports ``deep_ep`` (an ImportError here says how
            to build it), sizes the buffer by DeepEP's recommended configs and checks that
            inputs are CUDA bfloat16. Tests pass a stand-in.
    """

    def __init__(self, *, factory: DeepEPBufferFactory | None = None) -> None:
        if factory is None:
            module = import_deep_ep()
            self._factory: DeepEPBufferFactory = lambda group, hidden: _make_buffer(module, group, hidden)
            self._check_inputs = True
        else:
            self._factory = factory
            self._check_inputs = False
        self._buffers: dict[ProcessGroup, tuple[int, DeepEPBuffer]] = {}

    def buffer_for(self, group: ProcessGroup, hidden: torch.Tensor) -> DeepEPBuffer:
        """The group's buffer, made or enlarged for rows like ``hidden`` ``(tokens, hidden_size)``."""
        if self._check_inputs:
            check_deep_ep_input(hidden)
        row_bytes = hidden.shape[-1] * hidden.element_size()
        held = self._buffers.get(group)
        if held is not None and held[0] >= row_bytes:
            return held[1]
        buffer = self._factory(group, hidden)
        self._buffers[group] = (row_bytes, buffer)
        return buffer


def _make_buffer(module: Any, group: ProcessGroup, hidden: torch.Tensor) -> DeepEPBuffer:
    ranks = group.size()
    if ranks > _MAX_NVLINK_PEERS:
        raise ValueError(
            f"the DeepEP dispatcher runs DeepEP's intranode (NVLink) kernels, for at most "
            f"{_MAX_NVLINK_PEERS} ranks; the expert-parallel group has {ranks}"
        )
    buffer_class: Any = module.Buffer
    # As DeepEP's README sizes it: the larger NVLink size hint of its dispatch and combine configs.
    row_bytes = hidden.shape[-1] * max(hidden.element_size(), 2)
    configs = (buffer_class.get_dispatch_config(ranks), buffer_class.get_combine_config(ranks))
    nvl_bytes = max(int(config.get_nvl_buffer_size_hint(row_bytes, ranks)) for config in configs)
    buffer: DeepEPBuffer = buffer_class(group, nvl_bytes, 0)
    return buffer
