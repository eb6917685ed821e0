"""d9d pre-training: a Qwen3-MoE from scratch with pipeline, expert and fully sharded parallelism.

Run:  torchrun --nproc-per-node 4 examples/pretrain-qwen3-moe/train.py examples/pretrain-qwen3-moe/config.yaml

The data is generated (no download): each row is an arithmetic progression of token ids modulo
the vocabulary, so the next token is predictable from the previous two and the loss falls fast.
Checkpoints are written every ``trainer.checkpoint.every_steps``; the model is exported at the end
as one Hugging Face directory (config.json, safetensors) that transformers loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from d9d.hf import HFModelProvider, ScratchModelConfig, TokenBatch, TokenSample, causal_lm_task
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ConfigFileError,
    ExportTargetError,
    ForwardBackwardFinished,
    ProjectConfig,
    TrainingConfigurator,
    check_export_target,
)
from d9d.mesh import DistributedContext


class PretrainSection(BaseModel):
    """The synthetic data and where the model goes.

    Attributes:
        num_rows: Rows of generated tokens.
        sequence_length: Tokens per row.
        export_dir: Where the model is exported at the end; a previous export there is
            replaced, a directory holding other files stops the run before training.
        replace_export_dir: Replace ``export_dir`` even when it holds files d9d did not write.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_rows: int = Field(default=2048, ge=1)
    sequence_length: int = Field(default=32, ge=4)
    export_dir: Path = Path("runs/pretrain-qwen3-moe/export")
    replace_export_dir: bool = False


class PretrainConfig(ProjectConfig):
    """The quickstart's sections plus ``model`` (a config.json to start from) and ``pretrain``."""

    model: ScratchModelConfig
    pretrain: PretrainSection = PretrainSection()


class ProgressionRows:
    """Rows ``start, start + step, start + 2 * step, ...`` modulo ``vocab_size``, from a seed."""

    def __init__(self, *, num_rows: int, sequence_length: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab_size, (num_rows, 1), generator=generator)
        steps = torch.randint(1, 8, (num_rows, 1), generator=generator)
        self._ids = (starts + steps * torch.arange(sequence_length)) % vocab_size

    def __len__(self) -> int:
        return self._ids.shape[0]

    def __getitem__(self, index: int) -> TokenSample:
        return TokenSample(input_ids=self._ids[index])  # one document per row


def run(config: PretrainConfig) -> tuple[list[float], Path]:
    """Trains, checkpoints and exports; returns the step losses and the export directory."""
    section = config.pretrain
    # Before any work: an export_dir holding the user's own files is refused, not emptied.
    overwrite = check_export_target(section.export_dir, replace_other=section.replace_export_dir)
    vocab_size = config.model.config.vocab_size

    def rows(_: DistributedContext) -> ProgressionRows:
        return ProgressionRows(
            num_rows=section.num_rows,
            sequence_length=section.sequence_length,
            vocab_size=vocab_size,
            seed=config.trainer.seed,
        )

    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(config.model),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(dataset_factory=rows, collator=TokenBatch.collate, config=config.data),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    losses: list[float] = []
    with trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda event: losses.append(event.loss))
        trainer.train()
        export = trainer.export(
            section.export_dir, overwrite=overwrite, replace_other=section.replace_export_dir
        )
        if trainer.dist_context.is_main_process:
            print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f}; exported to {export}")
    return losses, export


USAGE = "usage: train.py CONFIG.yaml  (e.g. examples/pretrain-qwen3-moe/config.yaml)"


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    try:
        config = PretrainConfig.from_yaml(sys.argv[1])
    except ConfigFileError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    try:
        run(config)
    except ExportTargetError as e:
        print(f"{e} (pretrain.replace_export_dir: true)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
