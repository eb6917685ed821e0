"""DeepEPTokenDispatcher without DeepEP: its regrouping and autograd over a stand-in buffer, the
choice in parallelize_expert_parallel, and the errors. The real kernels: test_deep_ep_gpu.py."""

import copy
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    AllToAllTokenDispatcher,
    DeepEPBuffers,
    DeepEPTokenDispatcher,
    all_to_all,
    parallelize_expert_parallel,
)
from d9d.parallel._deep_ep_buffer import check_deep_ep_input

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 8, 6, 16, 8, 24


class FakeDeepEPBuffer:
    """DeepEP's intranode dispatch and combine, as its docs define them, over gloo all-to-alls.

    A token goes once to each rank holding one of its experts, with local ids (-1 elsewhere) and
    weights (0 elsewhere); rows arrive by source rank, then token order. Combine sums the rows
    sent back per source token.
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.ranks = group.size()

    def get_dispatch_layout(self, topk_idx, num_experts):
        per_rank = num_experts // self.ranks
        owner = torch.where(topk_idx >= 0, topk_idx // per_rank, -1)
        in_rank = (owner.unsqueeze(-1) == torch.arange(self.ranks)).any(dim=1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def _exchange(self, rows, send, receive):
        return all_to_all(rows, output_splits=receive, input_splits=send, group=self.group)

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
    ):
        if handle is not None:
            sources, send, receive, _ = handle
            return self._exchange(x[torch.cat(sources)], send, receive), None, None, None, None, None
        assert is_token_in_rank is not None and topk_idx is not None and topk_weights is not None
        assert num_tokens_per_expert is not None and topk_weights.dtype == torch.float32
        per_rank = num_tokens_per_expert.shape[0] // self.ranks
        sources = [is_token_in_rank[:, r].nonzero().squeeze(1) for r in range(self.ranks)]
        send = [len(s) for s in sources]
        receive_counts = torch.empty(self.ranks, dtype=torch.long)
        dist.all_to_all_single(receive_counts, torch.tensor(send), group=self.group)
        receive = receive_counts.tolist()
        local, weights = [], []
        for r, source in enumerate(sources):
            ids = topk_idx[source] - r * per_rank
            mine = (ids >= 0) & (ids < per_rank)
            local.append(torch.where(mine, ids, -1))
            weights.append(torch.where(mine, topk_weights[source], 0.0))
        recv_x = self._exchange(x[torch.cat(sources)], send, receive)
        recv_idx = self._exchange(torch.cat(local), send, receive)
        recv_weights = self._exchange(torch.cat(weights), send, receive)
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=per_rank).tolist()
        return recv_x, recv_idx, recv_weights, counts, (sources, send, receive, x.shape[0]), None

    def combine(self, x, handle, topk_weights=None):
        sources, send, receive, tokens = handle
        index = torch.cat(sources)
        rows = self._exchange(x, receive, send)
        out = x.new_zeros(tokens, x.shape[1]).index_add(0, index, rows)
        if topk_weights is None:
            return out, None, None
        weights = self._exchange(topk_weights, receive, send)
        return out, topk_weights.new_zeros(tokens, topk_weights.shape[1]).index_add(0, index, weights), None


class TinyExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) * 0.5)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        groups = tokens.split(tokens_per_expert.tolist())
        return torch.cat([torch.tanh(g @ self.w_in[e]) @ self.w_out[e] for e, g in enumerate(groups)])


class TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = EXPERTS, TOP_K
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.shared_expert = None
        self.experts = TinyExperts()
        self.dispatcher = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        tokens, counts = self.dispatcher.dispatch(x, indices, weights)
        return self.dispatcher.combine(self.experts(tokens, counts))


def _local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in model.named_parameters()
    }


def _matches_all_to_all() -> None:
    mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    reference = TinyMoE()
    model = copy.deepcopy(reference)
    made: list[int] = []

    def factory(group: ProcessGroup, hidden: torch.Tensor) -> FakeDeepEPBuffer:
        made.append(hidden.shape[-1])
        return FakeDeepEPBuffer(group)

    parallelize_expert_parallel(reference, mesh=mesh)
    buffers = DeepEPBuffers(factory=factory)
    parallelize_expert_parallel(model, mesh=mesh, dispatcher="deep_ep", deep_ep_buffers=buffers)
    assert isinstance(model.dispatcher, DeepEPTokenDispatcher)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    grad = torch.randn(TOKENS, HIDDEN, generator=generator)
    outputs, inputs = [], []
    for moe in (reference, model):
        for _ in range(2):  # a second step reuses the buffer
            leaf = x.clone().requires_grad_(True)
            out = moe(leaf)
            out.backward(grad)
        outputs.append(out.detach())
        inputs.append(leaf.grad)
    assert made == [HIDDEN]
    torch.testing.assert_close(outputs[1], outputs[0])
    torch.testing.assert_close(inputs[1], inputs[0])
    # Expert weights (local shards) and the router, whose gradient comes through the weights.
    expected, actual = _local_grads(reference), _local_grads(model)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, msg=name)


def test_deep_ep_dispatcher_matches_all_to_all_over_a_stand_in_buffer() -> None:
    # top-8 of 16 experts on 2 ranks: tokens reach one or both ranks, several experts per rank
    run_distributed(_matches_all_to_all, world_size=2, timeout_s=120)


def _choices_and_errors() -> None:
    group = dist.group.WORLD
    assert group is not None
    mesh = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("ep",))
    fake = DeepEPBuffers(factory=lambda g, h: FakeDeepEPBuffer(g))
    moe = TinyMoE()
    with pytest.raises(ValueError, match=r"dispatcher='deepep'; choose 'all_to_all' or 'deep_ep'"):
        parallelize_expert_parallel(moe, mesh=mesh, dispatcher="deepep")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"deep_ep_buffers is for dispatcher='deep_ep', not 'all_to_all'"):
        parallelize_expert_parallel(moe, mesh=mesh, deep_ep_buffers=fake)
    assert not isinstance(moe.experts.w_in, DTensor)  # nothing changed before the error
    parallelize_expert_parallel(moe, mesh=mesh)
    assert isinstance(moe.dispatcher, AllToAllTokenDispatcher)  # the default
    with pytest.raises(ValueError, match=r"num_experts=15 is not divisible by the expert-parallel degree 2"):
        DeepEPTokenDispatcher(num_experts=15, group=group, buffers=fake)
    dispatcher = DeepEPTokenDispatcher(num_experts=16, group=group, buffers=fake)
    with pytest.raises(RuntimeError, match=r"combine called without a preceding dispatch"):
        dispatcher.combine(torch.zeros(1, HIDDEN))
    with pytest.raises(ValueError, match=r"hidden \(T, H\) and expert ids and weights \(T, K\)"):
        dispatcher.dispatch(torch.zeros(4, HIDDEN), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 3))


def test_dispatcher_choice_and_argument_errors() -> None:
    run_distributed(_choices_and_errors, world_size=2, timeout_s=120)


def _missing_deep_ep() -> None:
    sys.modules["deep_ep"] = None  # type: ignore[assignment]  # import fails even where it is built
    mesh = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("ep",))
    moe = TinyMoE()
    with pytest.raises(ImportError, match=r"needs DeepEP .*scripts/build-deepep\.sh"):
        parallelize_expert_parallel(moe, mesh=mesh, dispatcher="deep_ep")
    assert not isinstance(moe.experts.w_in, DTensor)  # failed before sharding anything


def test_missing_deep_ep_is_a_clear_import_error() -> None:
    run_distributed(_missing_deep_ep, world_size=2, timeout_s=120)


def test_missing_deep_ep_fails_when_buffers_are_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    with pytest.raises(ImportError, match=r"'import deep_ep'.*docs/parallel\.md"):
        DeepEPBuffers()


def test_buffers_are_made_once_and_again_for_wider_rows() -> None:
    made: list[int] = []

    def factory(group, hidden):
        made.append(hidden.shape[-1])
        return object()

    buffers, group = DeepEPBuffers(factory=factory), object()
    first = buffers.buffer_for(group, torch.zeros(4, 16))
    assert buffers.buffer_for(group, torch.zeros(9, 8)) is first  # narrower rows fit
    assert buffers.buffer_for(group, torch.zeros(4, 32)) is not first  # wider rows: a new buffer
    assert made == [16, 32]


@pytest.mark.parametrize(
    ("hidden", "message"),
    [
        (torch.zeros(2, 16), r"bfloat16 rows only; the hidden states are torch\.float32"),  # fp32
        (torch.zeros(2, 16, dtype=torch.bfloat16), r"CUDA tensors; the hidden states are on cpu"),  # CPU
    ],
)
def test_inputs_deep_ep_does_not_take(hidden: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_deep_ep_input(hidden)
