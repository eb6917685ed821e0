"""Load-balanced sequence sharding for context parallelism.

With a causal mask, later tokens attend to more keys. The sequence is therefore cut into
``2 * cp`` equal chunks and rank ``r`` takes chunks ``r`` and ``2 * cp - 1 - r``: one early and
one late chunk, so every rank does the same attention work.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from d9d.parallel._load_balanced_positions import local_positions
from d9d.parallel._mesh_dims import require_one_dim
from d9d.parallel._sequence_all_gather import gather_sequence


def context_parallel_shard(tensor: torch.Tensor, *, mesh: DeviceMesh, seq_dim: int = 1) -> torch.Tensor:
    """Returns this rank's load-balanced part of ``tensor`` along its sequence dim.

    Apply it to every per-token tensor of a batch (inputs, labels, position ids, document ids)
    so they stay aligned.

    Args:
        tensor: A full-sequence tensor, the same on every cp rank.
        mesh: The 1-D context-parallel mesh.
        seq_dim: The tensor dim that holds the sequence.

    Raises:
        ValueError: If the sequence length is not divisible by ``2 * cp``.
    """
    require_one_dim(mesh, purpose="context_parallel_shard")
    positions = local_positions(
        tensor.shape[seq_dim], mesh.size(), mesh.get_local_rank(), device=tensor.device
    )
    return tensor.index_select(seq_dim, positions)


def context_parallel_unshard(local: torch.Tensor, *, mesh: DeviceMesh, seq_dim: int = 1) -> torch.Tensor:
    """Gathers every rank's part and puts the sequence back in order (inverse of the shard)."""
    require_one_dim(mesh, purpose="context_parallel_unshard")
    return gather_sequence(local, mesh=mesh, seq_dim=seq_dim)


def context_parallel_position_ids(
    batch_size: int, seq_len: int, *, mesh: DeviceMesh, device: torch.device | None = None
) -> torch.Tensor:
    """Position ids (batch_size, seq_len / cp) of this rank's tokens, for rotary embeddings."""
    require_one_dim(mesh, purpose="context_parallel_position_ids")
    positions = local_positions(seq_len, mesh.size(), mesh.get_local_rank(), device=device)
    return positions.unsqueeze(0).expand(batch_size, -1).contiguous()
