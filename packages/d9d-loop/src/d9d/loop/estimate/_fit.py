"""Refuses a job whose estimate exceeds the device, naming the amount over and what would fit."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

from d9d.loop.config._optimizer import HostOffloadConfig
from d9d.loop.estimate._estimate import estimate_memory
from d9d.loop.estimate._job import MemoryJob
from d9d.loop.estimate._report import GIB, largest
from d9d.loop.peft import LoRAConfig, NF4BaseConfig

_FSDP_DEGREES = (2, 4, 8, 16, 32, 64)
_SHORTEST_SEQUENCE = 256
_DEFAULT_CHUNK = HostOffloadConfig().chunk_mib << 20


class MemoryFitError(ValueError):
    """The job will not fit its device; the message says by how much and what would make it fit."""


def _peak(job: MemoryJob) -> int:
    return largest(estimate_memory(job)).total


def _every_layer_linear(job: MemoryJob) -> str:
    names = (
        re.escape(linear.name).replace(re.escape("{layer}"), r"\d+") for linear in job.model.layer_linears
    )
    return "|".join(f"^{name}$" for name in names)


def _single_switches(job: MemoryJob) -> Iterable[tuple[str, MemoryJob]]:
    model = job.model
    if not model.activation_checkpointing:
        recompute = replace(model, activation_checkpointing=True)
        yield "activation checkpointing (model.activation_checkpointing: true)", replace(job, model=recompute)
    if job.lora is None and model.layer_linears:
        lora = LoRAConfig(target=_every_layer_linear(job), r=16, alpha=32.0)
        yield "LoRA r16 on every decoder linear (trainer.peft: {kind: lora, ...})", replace(job, peft=lora)
    lora, mesh = job.lora, job.mesh
    unsharded = mesh.data_parallel_shard * mesh.context_parallel_shard * mesh.tensor_parallel == 1
    if lora is not None and job.base_bits is None and unsharded:  # NF4 is refused on a sharding mesh
        quantized = lora.model_copy(update={"base": NF4BaseConfig()})
        yield "a 4-bit base (trainer.peft.base: {kind: nf4})", replace(job, peft=quantized)
    if not job.optimizer.offloaded and job.optimizer.state_bytes > 0:
        offloaded = replace(job.optimizer, offloaded=True, staging_bytes=2 * _DEFAULT_CHUNK)
        switch = "the moments in host memory (optimizer: {name: stochastic_adamw, offload: {}})"
        yield switch, replace(job, optimizer=offloaded)
    if job.microbatch_size > 1:
        more = job.microbatches_per_step * job.microbatch_size
        smaller = replace(job, microbatch_size=1, microbatches_per_step=more)
        yield "trainer.microbatch_size: 1", smaller


def _first_fitting(candidates: Iterable[tuple[str, MemoryJob]], budget: int) -> tuple[str, MemoryJob] | None:
    return next(((name, job) for name, job in candidates if _peak(job) <= budget), None)


def _shorter(job: MemoryJob) -> Iterable[tuple[str, MemoryJob]]:
    length = job.sequence_length // 2
    while length >= _SHORTEST_SEQUENCE:
        yield f"sequence length {length}", replace(job, sequence_length=length)
        length //= 2


def _more_shards(job: MemoryJob) -> Iterable[tuple[str, MemoryJob]]:
    for degree in _FSDP_DEGREES:
        if degree > job.mesh.data_parallel_shard:
            mesh = job.mesh.model_copy(update={"data_parallel_shard": degree})
            yield f"FSDP over {degree} ranks (mesh.data_parallel_shard: {degree})", replace(job, mesh=mesh)


def fitting_switches(job: MemoryJob, budget: int) -> list[str]:
    """Each single change of the job that brings its peak within ``budget``, with its new peak."""
    found = [(name, other) for name, other in _single_switches(job) if _peak(other) <= budget]
    for search in (_shorter(job), _more_shards(job)):
        first = _first_fitting(search, budget)
        if first is not None:
            found.append(first)
    return [f"{name} ({_peak(other) / GIB:.2f} GiB)" for name, other in found]


def check_fits(job: MemoryJob, budget: int) -> None:
    """Raises ``MemoryFitError`` when the largest rank's peak exceeds ``budget`` bytes.

    The frozen weights alone exceeding it are named first (no recompute or batch change helps).
    """
    worst = largest(estimate_memory(job))
    if worst.total <= budget:
        return
    device = f"the device's {budget / GIB:.2f} GiB"
    rank = f" on pipeline rank {worst.pipeline_rank}" if job.mesh.pipeline_parallel > 1 else ""
    switches = fitting_switches(job, budget)
    fixes = (
        "; it would fit with: " + ", or ".join(switches) if switches else "; no single switch makes it fit"
    )
    if worst.frozen_weights > budget:
        raise MemoryFitError(
            f"the frozen weights alone need {worst.frozen_weights / GIB:.2f} GiB{rank}, more than {device}"
            f" (shard them over more ranks, or use a quantized base){fixes}"
        )
    raise MemoryFitError(
        f"the job needs {worst.total / GIB:.2f} GiB{rank} ({worst.phase}), over {device} by "
        f"{(worst.total - budget) / GIB:.2f} GiB{fixes}"
    )


def check_weights_fit(job: MemoryJob, budget: int) -> None:
    """Raises ``MemoryFitError`` when a rank's weights alone (frozen and trained) exceed ``budget``.

    The check that needs neither the sequence length nor the optimizer: whatever they add, a
    device smaller than the weights cannot run the job.
    """
    for estimate in estimate_memory(job):
        frozen = estimate.frozen_weights
        weights = frozen + estimate.components["weights, trained"]
        if weights > budget:
            rank = f" on pipeline rank {estimate.pipeline_rank}" if job.mesh.pipeline_parallel > 1 else ""
            raise MemoryFitError(
                f"the weights alone need {weights / GIB:.2f} GiB{rank} ({frozen / GIB:.2f} GiB of them "
                f"frozen), more than the device's {budget / GIB:.2f} GiB (shard them over more ranks, "
                "or use a quantized base)"
            )
