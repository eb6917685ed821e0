"""``d9d export``: a DCP training checkpoint, saved under any layout, to a Hugging Face directory."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch.distributed.checkpoint as dcp
from pydantic import TypeAdapter, ValidationError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from d9d.loop._model_provider import ModelProvider, StagesReadyContext
from d9d.loop._model_stage_factory import BuiltStage, ModelStageFactory
from d9d.loop.checkpoint._shapes import tensor_shapes
from d9d.loop.checkpoint._train_state import ModelState
from d9d.loop.checkpoint._weights_only_planner import WeightsOnlyLoadPlanner
from d9d.loop.cli._checkpoint_check import check_model_fit, read_checkpoint_metadata, verify_checkpoint
from d9d.loop.cli._errors import CommandError
from d9d.loop.config._trainer import InitializationConfig
from d9d.loop.export._exporter import ModelExporter
from d9d.loop.export._target import ExportTargetError, check_export_target
from d9d.loop.peft import FullFineTuningConfig, LoRAConfig, PeftConfig
from d9d.mesh import DistributedContext, MeshParameters
from d9d.pipeline import PipelineStageInfo

DEFAULT_PROVIDER = "d9d.hf:provider_from_config"
"""Builds d9d-hf models from the config's ``model`` section (when d9d-hf is installed)."""

ProviderFunction = Callable[[Mapping[str, Any]], ModelProvider[Any]]
"""``module:function`` of ``--provider``: the job's whole config (a mapping) to its model provider."""


def load_provider_function(spec: str) -> ProviderFunction:
    """Imports ``module:function``.

    Raises:
        CommandError: If the spec is malformed, the module is missing (d9d-hf for the default)
            or the attribute is not callable.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CommandError(f"--provider {spec!r} is not of the form module:function")
    if importlib.util.find_spec(module_name.split(".")[0]) is None or _missing(module_name):
        hint = (
            " (pip install d9d-hf, or name your own with --provider module:function)"
            if spec == DEFAULT_PROVIDER
            else ""
        )
        raise CommandError(f"--provider {spec}: module {module_name} is not installed{hint}")
    module = importlib.import_module(module_name)
    function: Any = getattr(module, attribute, None)
    if not callable(function):
        raise CommandError(f"--provider {spec}: {module_name} has no function {attribute}")
    return cast(ProviderFunction, function)


def _missing(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is None
    except ModuleNotFoundError:
        return True


def resolve_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a checkpoint (has ``.metadata``), else its newest ``step_*``.

    Raises:
        CommandError: If neither is found.
    """
    if (path / ".metadata").is_file():
        return path
    steps = [
        p
        for p in path.glob("step_*")
        if p.name.removeprefix("step_").isdigit() and (p / ".metadata").is_file()
    ]
    if not steps:
        raise CommandError(
            f"{path} is not a DCP checkpoint (no .metadata) nor a directory of step_* checkpoints"
        )
    return max(steps, key=lambda p: int(p.name.removeprefix("step_")))


def _trainer(config: Mapping[str, Any]) -> dict[str, Any]:
    trainer: Any = config.get("trainer")
    return cast(dict[str, Any], trainer) if isinstance(trainer, dict) else {}


def _trainer_section(
    config: Mapping[str, Any], key: str, adapter: TypeAdapter[Any], path: Path, *, default: Any
) -> Any:
    value: Any = _trainer(config).get(key)
    if value is None:
        return default
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        raise CommandError(f"{path}: trainer.{key} is not valid:\n{e}") from e


def export_checkpoint(
    *,
    config: Mapping[str, Any],
    config_path: Path,
    checkpoint: Path,
    target: Path,
    provider_function: ProviderFunction,
    replace_other: bool,
) -> Path:
    """Builds the whole model on one CPU process, loads the checkpoint's model state, exports it.

    DCP reshards on load, so a checkpoint saved under any data, tensor or pipeline layout loads
    into one unsharded model (a checkpoint's tensor names do not depend on the layout). With
    ``trainer.peft: {kind: lora}`` the base weights come from where training took them
    (``trainer.initialization.source`` or the provider) and the adapters from the checkpoint;
    ``peft.export`` says whether they are merged. Memory: one copy of the model, then the
    streaming safetensors writer (one file at a time).

    Before the model is built, the checkpoint's files are checked against its manifest
    (``verify_checkpoint``); before it loads, its model tensors against the model's
    (``check_model_fit``): a tensor missing on either side refuses the export.

    Raises:
        CommandError: On a bad config section, a target holding other files, a damaged
            checkpoint, or a checkpoint that does not match the model (naming the paths and
            the first tensors).
    """
    settings = _read_training_settings(config, config_path)
    try:
        overwrite = check_export_target(target, replace_other=replace_other)
    except ExportTargetError as e:
        raise CommandError(f"{e} (--force)") from e
    metadata = read_checkpoint_metadata(checkpoint)
    verify_checkpoint(checkpoint, metadata)
    try:
        provider = provider_function(config)
    except (ValueError, KeyError, TypeError) as e:
        raise CommandError(f"{config_path}: the model provider cannot be built from it: {e}") from e
    dist_context = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        built = _build_model(provider, dist_context, settings, config_path)
        state = ModelState([built.model], trainable_only=isinstance(settings.peft, LoRAConfig))
        _load_model_state(state, checkpoint, metadata, config_path)
        provider.stages_ready(
            StagesReadyContext(dist_context=dist_context, stages=[(built.stage, built.model)])
        )
        exporter = ModelExporter(
            provider=provider, stages=[built], dist_context=dist_context, peft=settings.peft
        )
        return exporter.export(target, overwrite=overwrite)
    finally:
        dist_context.close()


@dataclass(kw_only=True, frozen=True)
class _TrainingSettings:
    """What the training run built its model with: adapters, initialization, seed."""

    peft: PeftConfig
    initialization: InitializationConfig
    seed: int


def _read_training_settings(config: Mapping[str, Any], config_path: Path) -> _TrainingSettings:
    """The config's ``trainer.peft``, ``trainer.initialization`` and ``trainer.seed`` (defaults if unset).

    Raises:
        CommandError: If a section is not valid, naming the config file.
    """
    peft: PeftConfig = _trainer_section(
        config, "peft", TypeAdapter(PeftConfig), config_path, default=FullFineTuningConfig()
    )
    initialization: InitializationConfig = _trainer_section(
        config,
        "initialization",
        TypeAdapter(InitializationConfig),
        config_path,
        default=InitializationConfig(),
    )
    seed: Any = _trainer(config).get("seed", 0)
    return _TrainingSettings(
        peft=peft, initialization=initialization, seed=int(seed) if isinstance(seed, int) else 0
    )


def _build_model(
    provider: ModelProvider[Any],
    dist_context: DistributedContext,
    settings: _TrainingSettings,
    config_path: Path,
) -> BuiltStage[Any]:
    """The whole model as one stage, initialized as the training run initialized it."""
    factory = ModelStageFactory(
        provider=provider,
        dist_context=dist_context,
        config=settings.initialization,
        seed=settings.seed,
        peft=settings.peft,
    )
    try:
        return factory.build(PipelineStageInfo(current_stage=0, num_stages=1))
    except (OSError, ValueError) as e:
        raise CommandError(f"the model of {config_path} cannot be built: {type(e).__name__}: {e}") from e


def _load_model_state(state: ModelState, checkpoint: Path, metadata: Metadata, config_path: Path) -> None:
    """Loads the checkpoint's model tensors into ``state``, once they are checked to fit it.

    Raises:
        CommandError: If a tensor is missing on either side, or the load fails.
    """
    check_model_fit(
        checkpoint,
        metadata.state_dict_metadata,
        tensor_shapes({"model": state}),
        section="model",
        model=str(config_path),
    )
    try:
        dcp.load({"model": state}, checkpoint_id=str(checkpoint), planner=WeightsOnlyLoadPlanner())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CommandError(
            f"{checkpoint} does not hold this model's state (built from {config_path}): {first}"
        ) from e
