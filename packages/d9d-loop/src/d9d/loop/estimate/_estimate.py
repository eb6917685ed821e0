"""Each pipeline rank's peak device memory: the largest of three phases, component by component."""

from __future__ import annotations

import math
from dataclasses import dataclass

from d9d.loop.estimate._activations import (
    backward_working_bytes,
    head_bytes,
    microbatch_tokens,
    saved_per_layer_bytes,
)
from d9d.loop.estimate._job import MemoryJob
from d9d.loop.estimate._parameters import RankParameters, rank_parameters
from d9d.pipeline import PipelineStageInfo, layers_of_stage

COMPONENTS = (
    "weights, frozen",
    "weights, trained",
    "gradients",
    "optimizer state",
    "compute copies",
    "activations saved",
    "layer in backward",
    "LM head and loss",
)
"""The table's rows, in order (bytes live at the rank's peak)."""

ALLOCATOR_SLACK = 0.05
"""The caching allocator's rounding and fragmentation, as a share of the allocated peak."""


@dataclass(kw_only=True, frozen=True)
class RankEstimate:
    """One pipeline rank's predicted peak.

    Attributes:
        pipeline_rank: The rank's pipeline position (0 without pipeline parallelism).
        layers: The decoder layers it builds.
        phase: When the peak falls: ``forward and loss``, ``backward`` or ``optimizer step``.
        components: Bytes of each of ``COMPONENTS`` live at the peak.
        slack: The allocator's share on top (``ALLOCATOR_SLACK``).
    """

    pipeline_rank: int
    layers: range
    phase: str
    components: dict[str, int]
    slack: int

    @property
    def allocated(self) -> int:
        """Bytes allocated at the peak."""
        return sum(self.components.values())

    @property
    def total(self) -> int:
        """Bytes the device must hold: the allocated peak and the allocator's slack."""
        return self.allocated + self.slack

    @property
    def frozen_weights(self) -> int:
        """Bytes of the frozen weights alone (what no switch but sharding or quantizing shrinks)."""
        return self.components["weights, frozen"]


def estimate_memory(job: MemoryJob) -> list[RankEstimate]:
    """The predicted peak of every pipeline rank (one entry without pipeline parallelism)."""
    ranks = job.mesh.pipeline_parallel
    return [_rank(job, rank, ranks) for rank in range(ranks)]


def _compute_copies(job: MemoryJob, params: RankParameters) -> int:
    """FSDP's gathered units (the non-layer unit and two layers in flight), or on one data-parallel
    rank the stage's copy in the compute dtype when it is stored otherwise; a quantized base adds
    one dequantized layer."""
    mesh, model = job.mesh, job.model
    compute = model.compute_bytes
    dequantized = compute * params.largest_layer if job.base_bits is not None else 0
    if mesh.data_parallel_shard * mesh.context_parallel_shard > 1:
        return compute * (params.rest + 2 * params.largest_layer) + dequantized
    if model.storage_bytes == compute:
        return dequantized
    return compute * (params.frozen + params.trained) + dequantized


def _static(job: MemoryJob, params: RankParameters) -> dict[str, int]:
    model = job.model
    bits = job.base_bits
    bits = model.storage_bytes * 8 if bits is None else bits
    plain = (params.frozen - params.quantizable) * model.storage_bytes
    optimizer = job.optimizer
    return {
        "weights, frozen": plain + math.ceil(params.quantizable * bits / 8),
        "weights, trained": params.trained * model.storage_bytes,
        "optimizer state": optimizer.staging_bytes
        if optimizer.offloaded
        else params.trained * optimizer.state_bytes,
    }


def _rank(job: MemoryJob, rank: int, ranks: int) -> RankEstimate:
    model = job.model
    stage = PipelineStageInfo(current_stage=rank, num_stages=ranks)
    layers = layers_of_stage(stage, model.num_layers, last_stage_weight=model.last_stage_weight)
    params = rank_parameters(job, layers, is_first=stage.is_first, is_last=stage.is_last)
    tokens, adapted = microbatch_tokens(job), params.adapted_per_layer
    in_flight = min(job.microbatches_per_step, ranks - rank)  # 1F1B: the later ranks hold fewer
    saved = in_flight * len(layers) * saved_per_layer_bytes(job, tokens, adapted)
    grads = params.trained * model.storage_bytes
    head_grad = params.head_trained * model.storage_bytes
    accumulating = job.microbatches_per_step > 1  # gradients live across the step's microbatches
    head = head_bytes(job, tokens, head_trained=params.head_trained > 0) if stage.is_last else 0
    static = {**_static(job, params), "compute copies": _compute_copies(job, params)}
    forward = {**static, "gradients": grads if accumulating else 0, "activations saved": saved}
    forward["LM head and loss"] = head
    if accumulating or saved + head_grad < grads:
        backward = {**static, "gradients": grads, "activations saved": saved if accumulating else 0}
    else:
        backward = {**static, "gradients": head_grad, "activations saved": saved}
    backward["layer in backward"] = backward_working_bytes(job, tokens, adapted)
    step = {**_static(job, params), "gradients": grads}
    phases = {"forward and loss": forward, "backward": backward, "optimizer step": step}
    phase = max(phases, key=lambda name: sum(phases[name].values()))
    components = {name: phases[phase].get(name, 0) for name in COMPONENTS}
    slack = int(ALLOCATOR_SLACK * sum(components.values()))
    return RankEstimate(pipeline_rank=rank, layers=layers, phase=phase, components=components, slack=slack)
