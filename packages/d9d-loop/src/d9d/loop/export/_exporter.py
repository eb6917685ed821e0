"""Exports the model as one safetensors directory under any mesh layout, pipeline included."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from d9d.loop._model_provider import ModelProvider, PrepareExportModelStageContext
from d9d.loop._model_stage_factory import BuiltStage
from d9d.loop.export._target import write_export_marker
from d9d.loop.peft import FullFineTuningConfig, PeftConfig
from d9d.loop.peft._export import export_view, write_peft_layout
from d9d.mesh import DistributedContext
from d9d.state_mappers import save_module_state

INDEX_FILE = "model.safetensors.index.json"


class ExportError(RuntimeError):
    """An export failed; the message names the stage and rank, and what was left on disk."""


class ModelExporter:
    """Writes every pipeline stage's tensors into one merged directory (collective over all ranks).

    Each stage is saved by the ranks that hold it (the stage group, so FSDP/TP shards are gathered
    within a stage only) into a hidden parts directory; the main rank then merges the stages'
    files into one index, adds the provider's extra files (e.g. ``config.json``) and renames the
    result into place. The target appears complete or not at all.
    """

    def __init__(
        self,
        *,
        provider: ModelProvider[Any],
        stages: Sequence[BuiltStage[Any]],
        dist_context: DistributedContext,
        peft: PeftConfig | None = None,
        base_model: str | None = None,
    ) -> None:
        """``peft``: with LoRA, export the merged model or the adapters alone (PEFT's format, its
        ``base_model_name_or_path`` set to ``base_model``)."""
        self._peft: PeftConfig = peft or FullFineTuningConfig()
        self._base_model = base_model
        self._provider = provider
        self._stages = stages
        self._dist = dist_context

    def export(self, target: Path | str, *, overwrite: bool = False) -> Path:
        """Exports the model to ``target`` and returns it.

        Args:
            target: The directory to create.
            overwrite: Replace an existing non-empty ``target`` (it stays intact if the export
                fails). The caller decides what may be replaced: ``Trainer.export`` and
                ``check_export_target`` refuse a directory holding files no d9d export wrote.

        Raises:
            FileExistsError: If ``target`` is not empty and ``overwrite`` is False (before any work).
            ExportError: If a stage failed to save on some rank; nothing is left at ``target``.
        """
        target = Path(target)
        if target.exists() and not overwrite and not (target.is_dir() and not any(target.iterdir())):
            raise FileExistsError(
                f"export target {target} exists and is not empty; nothing was written. "
                "Pass overwrite=True to replace it"
            )
        parts = target.parent / f".{target.name}.parts"
        staging = target.parent / f".{target.name}.partial-export"
        if self._dist.is_main_process:
            target.parent.mkdir(parents=True, exist_ok=True)
            for stale in (parts, staging):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier(group=self._dist.world_group())
        errors, files = self._gather(self._save_stages(parts))
        if not errors and self._dist.is_main_process:
            errors += self._assemble(parts, staging, target, files, overwrite=overwrite)
        if self._dist.is_main_process:
            shutil.rmtree(parts, ignore_errors=True)
            shutil.rmtree(staging, ignore_errors=True)
        verdict: list[list[str] | None] = [errors]
        dist.broadcast_object_list(verdict, src=0, group=self._dist.world_group())
        if verdict[0]:
            raise ExportError(
                f"export to {target} failed; nothing was written there ({'; '.join(verdict[0])})"
            )
        return target

    def _save_stages(self, parts: Path) -> tuple[str | None, dict[str, bytes]]:
        """Saves this rank's stages under ``parts``: the error that stopped it, the provider's files."""
        extra_files: dict[str, bytes] = {}
        try:
            for built in self._stages:
                result = self._provider.prepare_export_model_stage(
                    PrepareExportModelStageContext(
                        dist_context=self._dist, stage=built.stage, model=built.model
                    )
                )
                module, mapper, with_files = export_view(built.model, result.state_mapper, self._peft)
                if with_files:
                    extra_files.update(result.files)
                save_module_state(
                    parts / f"stage_{built.stage.current_stage:05d}",
                    module,
                    mapper,
                    process_group=self._dist.stage_group(),
                    show_progress=self._dist.is_main_process,
                )
        except Exception as e:
            return f"rank {self._dist.rank}: {type(e).__name__}: {e}", extra_files
        return None, extra_files

    def _gather(self, outcome: tuple[str | None, dict[str, bytes]]) -> tuple[list[str], dict[str, bytes]]:
        """Every rank's error and extra files (collective): the errors, and the files of all ranks."""
        outcomes: list[tuple[str | None, dict[str, bytes]] | None] = [None] * self._dist.world_size
        dist.all_gather_object(outcomes, outcome, group=self._dist.world_group())
        errors = [o[0] for o in outcomes if o is not None and o[0] is not None]
        files: dict[str, bytes] = {}
        for gathered in outcomes:
            if gathered is not None:
                files.update(gathered[1])
        return errors, files

    def _assemble(
        self, parts: Path, staging: Path, target: Path, files: dict[str, bytes], *, overwrite: bool
    ) -> list[str]:
        """Merges the stages into ``staging`` and renames it to ``target`` (main rank): errors met."""
        try:
            _merge(parts, staging, files)
            write_peft_layout(staging, self._peft, base_model=self._base_model)
            write_export_marker(staging)  # last: it lists every file the export wrote
            _replace(staging, target, overwrite=overwrite)
        except Exception as e:
            return [f"rank {self._dist.rank} (merging): {type(e).__name__}: {e}"]
        return []


def _merge(parts: Path, staging: Path, extra_files: dict[str, bytes]) -> None:
    """Moves every stage's shard files into ``staging`` with one index over all of them."""
    staging.mkdir(parents=True)
    indexes = sorted(parts.iterdir())
    files = [
        (stage_dir, name)
        for stage_dir in indexes
        for name in sorted(set(json.loads((stage_dir / INDEX_FILE).read_text())["weight_map"].values()))
    ]
    weight_map: dict[str, str] = {}
    total_size = 0
    renamed: dict[tuple[Path, str], str] = {
        key: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, key in enumerate(files)
    }
    for stage_dir in indexes:
        index = json.loads((stage_dir / INDEX_FILE).read_text())
        total_size += int(index["metadata"]["total_size"])
        for tensor, file_name in index["weight_map"].items():
            if tensor in weight_map:
                raise ValueError(
                    f"tensor '{tensor}' is exported by two pipeline stages ({stage_dir.name} and an "
                    "earlier one); the providers' export mappers must give each tensor to one stage"
                )
            weight_map[tensor] = renamed[(stage_dir, file_name)]
    for (stage_dir, name), new_name in renamed.items():
        os.replace(stage_dir / name, staging / new_name)
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
    for name, content in extra_files.items():
        (staging / name).write_bytes(content)


def _replace(staging: Path, target: Path, *, overwrite: bool) -> None:
    old: Path | None = None
    if target.exists():
        if not overwrite and any(target.iterdir()):
            raise FileExistsError(f"{target} appeared while exporting; nothing was written there")
        old = target.parent / f".{target.name}.replaced"
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    staging.rename(target)
    if old is not None:
        shutil.rmtree(old)
