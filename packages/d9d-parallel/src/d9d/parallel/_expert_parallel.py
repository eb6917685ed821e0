"""Expert parallelism for MoE layers that expose d9d's dispatcher slot."""

from __future__ import annotations

from typing import Literal, Protocol

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from d9d.parallel._deep_ep_buffer import DeepEPBuffers
from d9d.parallel._deep_ep_dispatcher import DeepEPTokenDispatcher
from d9d.parallel._local_forward import LocalParameterSlot, install_local_forward
from d9d.parallel._mesh_dims import mesh_dim_names, shard_dim_name
from d9d.parallel._module_parameters import owned_parameters, require_parameters
from d9d.parallel._reduction import GradientReduction, partial_for
from d9d.parallel._replicate import parallelize_replicate
from d9d.parallel._token_dispatcher import AllToAllTokenDispatcher, TokenDispatcher

TokenDispatcherKind = Literal["all_to_all", "deep_ep"]
"""Which dispatcher ``parallelize_expert_parallel`` installs: ``AllToAllTokenDispatcher`` (any
backend) or ``DeepEPTokenDispatcher`` (DeepEP's NVLink kernels; CUDA bfloat16, one host)."""


class MoELayerLike(Protocol):
    """What ``parallelize_expert_parallel`` needs of a MoE layer (d9d-kernels' ``MoELayer`` fits).

    Members are read-only properties, so a layer whose attributes have narrower types
    (``router: TopKRouter``) fits; only the ``dispatcher`` slot is written, and it is a settable
    property because a mutable attribute member would be invariant.
    """

    @property
    def num_experts(self) -> int:
        """Global expert count."""
        ...

    @property
    def top_k(self) -> int:
        """Experts per token."""
        ...

    @property
    def router(self) -> nn.Module:
        """Picks experts per token; replicated."""
        ...

    @property
    def shared_expert(self) -> nn.Module | None:
        """An always-on dense expert, if any; replicated."""
        ...

    @property
    def experts(self) -> nn.Module:
        """Parameters lead with the expert dim; forward takes tokens grouped by expert and counts."""
        ...

    @property
    def dispatcher(self) -> TokenDispatcher:
        """The token dispatcher the layer calls around ``experts``; replaced here."""
        ...

    @dispatcher.setter
    def dispatcher(self, dispatcher: TokenDispatcher) -> None: ...


def parallelize_expert_parallel(
    moe: MoELayerLike,
    *,
    mesh: DeviceMesh,
    gradient_reduction: GradientReduction = "mean",
    dispatcher: TokenDispatcherKind = "all_to_all",
    deep_ep_buffers: DeepEPBuffers | None = None,
) -> None:
    """Shards the experts over the expert-parallel ranks and installs an expert-parallel dispatcher.

    Every ``experts`` parameter becomes a DTensor placed ``Shard(0)`` (over the expert dim) on
    the ep dim of ``mesh`` and ``Replicate()`` on its other dims; the router and the shared
    expert are replicated over the whole mesh (``parallelize_replicate``). Forward runs on local
    tensors, so ``experts`` computes with its ``E / ep`` local experts. Each rank's tokens are
    its own data, so an expert's gradient sums the contributions of all ep ranks' tokens; with
    ``gradient_reduction="mean"`` it is divided by the ep degree and averaged over the other
    dims, matching the averaged gradients of the replicated parameters.

    Args:
        moe: The MoE layer, changed in place (its ``dispatcher`` is replaced).
        mesh: A 1-D ep mesh, or a mesh whose dim named ``*shard`` is the ep dim (e.g. d9d's
            expert domain ``mesh["ep_replicate", "ep_shard"]``); other dims are replicas.
        gradient_reduction: Average (default) or sum gradients over the data-parallel ranks.
        dispatcher: ``"all_to_all"`` (default) or ``"deep_ep"``; both give the same results.
        deep_ep_buffers: With ``"deep_ep"``, buffers shared by the layers given the same object
            (pass one to every layer of a model); a private one per layer when None.

    Raises:
        ValueError: If the mesh lacks the ep dim, ``num_experts`` is not divisible by the ep
            degree, an expert parameter does not lead with ``num_experts``, the dispatcher is
            unknown, or ``deep_ep_buffers`` comes without ``"deep_ep"``.
        ImportError: If ``"deep_ep"`` is chosen and DeepEP is not installed.
    """
    layer = type(moe).__name__
    purpose = f"parallelize_expert_parallel on {layer}"
    names = mesh_dim_names(mesh, purpose=purpose)
    ep_dim = names[0] if mesh.ndim == 1 else shard_dim_name(mesh, purpose=purpose)
    ep_index = names.index(ep_dim)
    ep = mesh.size(ep_index)
    if moe.num_experts % ep != 0:
        raise ValueError(
            f"{purpose}: num_experts={moe.num_experts} is not divisible by the expert-parallel "
            f"degree {ep} (mesh dim {ep_dim!r})"
        )
    require_parameters(moe.experts, purpose=purpose)
    # The dispatcher first: a missing DeepEP fails before any parameter is replaced.
    group = mesh.get_group(ep_index)
    token_dispatcher = _make_dispatcher(
        dispatcher, num_experts=moe.num_experts, group=group, deep_ep_buffers=deep_ep_buffers, purpose=purpose
    )
    placements: list[Placement] = [Replicate()] * mesh.ndim
    placements[ep_index] = Shard(0)
    grad_placements = tuple(
        p if isinstance(p, Shard) else partial_for(gradient_reduction) for p in placements
    )
    grad_scale = 1.0 / ep if gradient_reduction == "mean" else 1.0
    slots: list[LocalParameterSlot] = []
    for owned in owned_parameters(moe.experts):
        parameter = owned.parameter
        if isinstance(parameter, DTensor):
            raise ValueError(f"{purpose}: expert parameter {owned.qualified_name} is already a DTensor")
        if parameter.ndim == 0 or parameter.shape[0] != moe.num_experts:
            raise ValueError(
                f"{purpose}: expert parameter {owned.qualified_name} has shape {tuple(parameter.shape)}; "
                f"its leading dim must be num_experts={moe.num_experts}"
            )
        data = parameter.detach()
        sharded = (
            DTensor.from_local(
                data.chunk(ep)[mesh.get_local_rank(ep_index)], mesh, placements, run_check=False
            )
            if data.is_meta
            else distribute_tensor(data, mesh, placements)
        )
        setattr(owned.owner, owned.name, nn.Parameter(sharded, requires_grad=parameter.requires_grad))
        slots.append(
            LocalParameterSlot(
                owner=owned.owner, name=owned.name, grad_placements=grad_placements, grad_scale=grad_scale
            )
        )
    install_local_forward(moe.experts, slots)
    for dense in (moe.router, moe.shared_expert):
        if dense is not None and any(not isinstance(p, DTensor) for p in dense.parameters()):
            parallelize_replicate(dense, mesh=mesh, gradient_reduction=gradient_reduction)
    moe.dispatcher = token_dispatcher


def _make_dispatcher(
    kind: TokenDispatcherKind,
    *,
    num_experts: int,
    group: ProcessGroup,
    deep_ep_buffers: DeepEPBuffers | None,
    purpose: str,
) -> TokenDispatcher:
    if deep_ep_buffers is not None and kind != "deep_ep":
        raise ValueError(f"{purpose}: deep_ep_buffers is for dispatcher='deep_ep', not {kind!r}")
    match kind:
        case "all_to_all":
            return AllToAllTokenDispatcher(num_experts=num_experts, group=group)
        case "deep_ep":
            return DeepEPTokenDispatcher(num_experts=num_experts, group=group, buffers=deep_ep_buffers)
        case _:  # a string from untyped code
            raise ValueError(f"{purpose}: dispatcher={kind!r}; choose 'all_to_all' or 'deep_ep'")
