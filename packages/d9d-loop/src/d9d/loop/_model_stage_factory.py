"""Builds each local model stage: meta construction, parallelization, materialization, init or load."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from d9d.loop._model_provider import (
    InitializeModelStageContext,
    LoadModelStageContext,
    ModelProvider,
    ModelT,
    ParallelizeModelStageContext,
)
from d9d.loop.config._trainer import InitializationConfig
from d9d.loop.peft import (
    FullFineTuningConfig,
    PeftConfig,
    QuantizationReport,
    apply_peft,
    quantize_bases,
    reset_adapters,
    stage_bases_on_host,
    without_adapters,
)
from d9d.mesh import DistributedContext, derived_seed
from d9d.pipeline import PipelineStageInfo
from d9d.state_mappers import StateMapper, load_module_state


@dataclass(kw_only=True, frozen=True)
class BuiltStage(Generic[ModelT]):
    """One materialized, parallelized model stage."""

    stage: PipelineStageInfo
    model: ModelT
    meta_model: nn.Module | None = None
    loaded_by_provider: bool = False  # the provider's ``load_model_stage`` gave the values


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise TypeError(
            f"model stage {type(module).__name__} has no reset_parameters(); d9d initializes every "
            f"stage by calling it (or set trainer.initialization.source to load weights)"
        )
    with torch.no_grad():
        reset()


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # every name of a shared tensor: a tied head is "lm_head.weight" on the last stage
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


class ModelStageFactory(Generic[ModelT]):
    """Turns a ``ModelProvider`` into ready model stages.

    Order: build on ``meta`` -> ``parallelize_model_stage`` (parameters become DTensors) ->
    ``to_empty`` on the device -> values from the provider's ``load_model_stage``, else from
    ``reset_parameters()`` (layout-invariant by default,
    see ``InitializationConfig``) or from a source checkpoint through the provider's state mapper.

    Layout-invariant initialization runs ``reset_parameters()`` on an unsharded host copy of the
    model as one process builds it, seeded as one process seeds it, and copies each tensor into
    the stage by name. With pipeline parallelism that copy is the whole model (built once per rank
    with a one-stage ``PipelineStageInfo``): a stage's ``reset_parameters()`` alone would draw its
    layers from another point of the random stream than one process does. So stage tensors must
    carry the whole model's names (global layer indices), as checkpoints require too.
    """

    def __init__(
        self,
        *,
        provider: ModelProvider[ModelT],
        dist_context: DistributedContext,
        config: InitializationConfig,
        seed: int,
        peft: PeftConfig | None = None,
    ) -> None:
        self._peft: PeftConfig = peft or FullFineTuningConfig()
        self._provider = provider
        self._dist = dist_context
        self._config = config
        self._seed = seed
        self._whole: nn.Module | None = None  # the initialized whole model (pipeline stages copy from it)

    def build(self, stage: PipelineStageInfo, *, keep_meta_copy: bool = False) -> BuiltStage[ModelT]:
        """Builds, parallelizes and initializes one stage.

        Args:
            stage: Which stage to build.
            keep_meta_copy: Also return an unparallelized copy on the meta device (for pipeline
                shape inference).
        """
        with torch.device("meta"):
            result = self._provider.initialize_model_stage(
                InitializeModelStageContext(dist_context=self._dist, stage=stage)
            )
        model = result.model
        # Adapters go in on the meta device, before parallelization: the provider's parallelize
        # then shards them with their base layer (FSDP shards every parameter of a module).
        apply_peft(model, self._peft)
        shadow = copy.deepcopy(model) if self._layout_invariant and stage.num_stages == 1 else None
        meta_model = copy.deepcopy(model) if keep_meta_copy else None
        self._provider.parallelize_model_stage(
            ParallelizeModelStageContext(dist_context=self._dist, stage=stage, model=model)
        )
        stage_bases_on_host(model, self._peft, self._dist.device)
        # Seed per stage: stages must not draw the same numbers, while every rank of one stage must.
        torch.manual_seed(derived_seed(self._seed, stage.current_stage))
        loaded = self._provider.load_model_stage(
            LoadModelStageContext(dist_context=self._dist, stage=stage, model=model)
        ).loaded
        self._initialize(stage, model, loaded=loaded, state_mapper=result.state_mapper, shadow=shadow)
        _log_quantization(self._dist, quantize_bases(model, self._peft, self._dist.device))
        return BuiltStage(stage=stage, model=model, meta_model=meta_model, loaded_by_provider=loaded)

    @property
    def _layout_invariant(self) -> bool:
        """Whether fresh values come from an unsharded model (no source checkpoint, the default)."""
        return self._config.source is None and self._config.layout_invariant

    def _initialize(
        self,
        stage: PipelineStageInfo,
        model: nn.Module,
        *,
        loaded: bool,
        state_mapper: StateMapper | None,
        shadow: nn.Module | None,
    ) -> None:
        """Gives the stage the values its provider did not load, and its adapters their start.

        From ``trainer.initialization.source`` through the provider's state mapper, else from
        ``reset_parameters()``: on ``shadow`` (a one-stage model's unsharded copy), on the whole
        model (a pipeline stage, layout-invariant) or on the stage itself.
        """
        source, invariant = self._config.source, self._layout_invariant
        if loaded:
            if source is not None:
                raise ValueError(
                    f"trainer.initialization.source={source} is set but "
                    f"{type(self._provider).__name__} loads the model from its own source; set only one "
                    f"(for inference from a safetensors export: build the provider from the export, "
                    f"e.g. d9d-hf's PretrainedModelConfig(source=<export dir>), and leave "
                    f"InferenceConfig.weights unset)"
                )
        elif source is not None:
            self._load_source(stage, model, source, state_mapper)
        elif shadow is not None:
            shadow.to_empty(device="cpu")
            _reset(shadow)
            reset_adapters(shadow)
            _copy_full_into(model, shadow)
        elif invariant:
            _copy_full_into(model, self._whole_model())
        else:
            _reset(model)
        if loaded or source is not None or not invariant:
            reset_adapters(model)  # whatever the base weights came from, adapters start at B = 0

    def _load_source(
        self, stage: PipelineStageInfo, model: nn.Module, source: Path, state_mapper: StateMapper | None
    ) -> None:
        """Loads the base weights of ``trainer.initialization.source`` into the stage."""
        if state_mapper is None:
            raise ValueError(
                f"trainer.initialization.source is set but {type(self._provider).__name__}."
                f"initialize_model_stage returned no state_mapper"
            )
        load_module_state(
            source,
            # the base checkpoint has no adapters: load into the model's tensors without them
            without_adapters(model),
            state_mapper,
            # a pipeline stage reads only its own tensors of the whole model's checkpoint
            strict=stage.num_stages == 1,
            show_progress=self._dist.is_main_process,
        )

    def _whole_model(self) -> nn.Module:
        """The whole model on the host, initialized as one process initializes it (built once)."""
        if self._whole is None:
            whole_stage = PipelineStageInfo(current_stage=0, num_stages=1)
            with torch.device("meta"):
                whole = self._provider.initialize_model_stage(
                    InitializeModelStageContext(dist_context=self._dist, stage=whole_stage)
                ).model
            apply_peft(whole, self._peft)
            whole.to_empty(device="cpu")
            # one process's seed; the stage's own random stream (seeded above) is left as it was
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derived_seed(self._seed, whole_stage.current_stage))
                _reset(whole)
                reset_adapters(whole)
            self._whole = whole
        return self._whole


def _log_quantization(dist: DistributedContext, report: QuantizationReport | None) -> None:
    if report is not None:
        dist.logger.info(
            f"4-bit base: {report.layers} LoRA base weights in NF4, {report.dense_bytes / 2**30:.2f} GiB -> "
            f"{report.quantized_bytes / 2**30:.2f} GiB, relative error {report.relative_error:.4f}"
        )


def _copy_full_into(target: nn.Module, full: nn.Module) -> None:
    """Copies every parameter and buffer of an unsharded module into its parallelized twin."""
    source: dict[str, torch.Tensor] = dict(_named_tensors(full))
    with torch.no_grad():
        for name, tensor in _named_tensors(target):
            value = source.get(name)
            if value is None:
                raise KeyError(f"parallelized model has '{name}', which the unsharded model lacks")
            _assign(tensor, value, name)


def _assign(tensor: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if isinstance(tensor, DTensor):
        dtensor: Any = tensor
        if tuple(dtensor.shape) != tuple(value.shape):
            raise ValueError(
                f"'{name}': parallelized shape {tuple(dtensor.shape)} != full shape {tuple(value.shape)}"
            )
        local = distribute_tensor(
            value.to(device=dtensor.device, dtype=dtensor.dtype),
            dtensor.device_mesh,
            dtensor.placements,
            src_data_rank=None,  # every rank holds the full value: slice locally, no communication
        ).to_local()
        dtensor.to_local().copy_(local)
    else:
        if tuple(tensor.shape) != tuple(value.shape):
            raise ValueError(
                f"'{name}': parallelized shape {tuple(tensor.shape)} != full shape {tuple(value.shape)}"
            )
        tensor.copy_(value)
