"""d9d fine-tuning: supervised fine-tuning of a Qwen3 causal LM on your own data, from a config.

Run:        uv run examples/finetune-qwen3/train.py examples/finetune-qwen3/config.yaml
Scale out:  set `mesh: {data_parallel_shard: 4}` and run
            torchrun --nproc-per-node 4 examples/finetune-qwen3/train.py config.yaml

The `dataset` section says where the samples are (JSONL, Parquet, a Hugging Face dataset), their
format (chat, prompt_completion, text) and how they become rows (packing, sequence_length,
streaming); d9d-hf's `sft_data_provider` does the rest. A held-out split is evaluated before and
after training; the model is exported as a Hugging Face directory that transformers loads.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from toy_setup import record_texts, write_tiny_checkpoint, write_toy_pairs

from d9d.hf import (
    CausalLMTask,
    DecoderInputs,
    HFModelConfig,
    HFModelProvider,
    PretrainedModelConfig,
    ScratchModelConfig,
    TokenBatch,
    causal_lm_task,
    resolve_snapshot,
)
from d9d.hf.data import SFTDataConfig, sft_data_provider
from d9d.loop import (
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    BuildForwardInputsContext,
    ConfigFileError,
    DataError,
    EventBus,
    ExportTargetError,
    ProjectConfig,
    Trainer,
    TrainingConfigurator,
    check_export_target,
)
from d9d.loop.data import TokenDataProvider
from d9d.mesh import DistributedContext


class FinetuneSection(BaseModel):
    """Where generated files go and where the model is exported.

    Attributes:
        work_dir: The generated tiny checkpoint (when ``model`` is null) lives here.
        toy_data: Write the toy prompt/completion set to ``dataset.source`` when it is missing
            (set false for your own data: a missing file is then an error).
        export_dir: Where the fine-tuned model is exported. A previous export there is replaced;
            any other non-empty directory stops the run before training, unless
            ``replace_export_dir``.
        replace_export_dir: Replace ``export_dir`` even when it holds files d9d did not write.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    work_dir: Path = Path("runs/finetune-qwen3")
    toy_data: bool = False
    export_dir: Path = Path("runs/finetune-qwen3/export")
    replace_export_dir: bool = False


class FinetuneConfig(ProjectConfig):
    """The quickstart's sections plus ``model`` (null: a tiny Qwen3), ``dataset`` and ``finetune``."""

    model: HFModelConfig | None = None
    dataset: SFTDataConfig
    finetune: FinetuneSection = FinetuneSection()


class ToyDataPathError(ValueError):
    """``finetune.toy_data`` would write the toy set outside ``finetune.work_dir``."""


def check_toy_data_path(config: FinetuneConfig) -> None:
    """Refuses, before any work, to write toy data anywhere but inside ``finetune.work_dir``.

    With ``toy_data: true`` a missing ``dataset.source`` is generated; a typo in that path would
    otherwise put a toy file next to the user's data and train on it.
    """
    section, source = config.finetune, config.dataset.source
    if not section.toy_data or source.kind != "jsonl" or source.path.exists():
        return
    if not source.path.resolve().is_relative_to(section.work_dir.resolve()):
        raise ToyDataPathError(
            f"finetune.toy_data: dataset.source {source.path} does not exist and is outside "
            f"finetune.work_dir {section.work_dir}: toy data is only written inside work_dir (a typo "
            "in the path?); fix dataset.source, or set finetune.toy_data: false"
        )


def prepare_model(config: FinetuneConfig) -> HFModelConfig:
    """The model section, generating the toy data and the tiny checkpoint where they are asked for."""
    section = config.finetune
    source = config.dataset.source
    if section.toy_data and source.kind == "jsonl" and not source.path.exists():
        write_toy_pairs(source.path, seed=config.trainer.seed)
    if config.model is not None:
        return config.model
    checkpoint = section.work_dir / "tiny-qwen3"
    if not checkpoint.exists():
        if source.kind != "jsonl":
            raise ValueError(
                "the generated tiny model needs a JSONL dataset.source to train its tokenizer on"
            )
        write_tiny_checkpoint(checkpoint, texts=record_texts(source.path), seed=config.trainer.seed)
    return PretrainedModelConfig(source=str(checkpoint))


def tokenizer_directory(model_config: HFModelConfig) -> Path:
    """Where ``tokenizer.json`` is: the checkpoint (cached by the provider) or the scratch config's."""
    match model_config:
        case PretrainedModelConfig():
            return resolve_snapshot(model_config.source, revision=model_config.revision)
        case ScratchModelConfig():
            if model_config.tokenizer is None:
                raise ValueError(
                    "model.tokenizer is needed to tokenize the data of a model trained from scratch"
                )
            return model_config.tokenizer


@torch.no_grad()
def evaluate(trainer: Trainer, data: TokenDataProvider[TokenBatch]) -> float | None:
    """Mean target-token loss over the held-out rows, forward only (every rank runs all rows).

    None under pipeline or context parallelism, where one rank's forward is not the whole model.
    """
    mesh = trainer.dist_context.parameters
    rows = data.held_out
    if mesh.pipeline_parallel > 1 or mesh.context_parallel > 1 or not rows:
        return None
    model = trainer.model_stages[0]
    device = trainer.dist_context.device
    task = CausalLMTask()
    total, count = 0.0, 0
    model.eval()
    for start in range(0, len(rows), 8):
        batch = data.collate(rows[start : start + 8])
        built = task.build_forward_inputs(BuildForwardInputsContext(batch=batch, step=0))
        losses = model(_to(built.input, device), None)
        total += float(losses.sum())
        count += int((built.state.targets != -100).sum())
    model.train()
    return total / max(count, 1)


def _to(inputs: DecoderInputs, device: torch.device) -> DecoderInputs:
    def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(device)

    return DecoderInputs(
        input_ids=inputs.input_ids.to(device),
        labels=move(inputs.labels),
        document_ids=move(inputs.document_ids),
        position_ids=move(inputs.position_ids),
    )


@dataclass(kw_only=True, frozen=True)
class RunResult:
    """What a run did.

    Attributes:
        before: Held-out loss before training (None: no held-out split, pipeline or context
            parallel, or nothing left to train).
        after: Held-out loss after training.
        export: Where the model was exported.
        finished_at: The step a previous run of this config had already finished at (its
            checkpoint was resumed and nothing was trained); None when this run trained.
    """

    before: float | None
    after: float | None
    export: Path
    finished_at: int | None


def run(config: FinetuneConfig, *, events: EventBus | None = None) -> RunResult:
    """Fine-tunes and exports; returns the held-out loss before and after, and the export.

    ``events`` carries the caller's subscriptions to the trainer's events (losses, checkpoints),
    e.g. to record every rank's losses when this runs under ``torchrun``.
    """
    # Before any work: an export_dir holding the user's own files is refused, not emptied, and
    # toy data is written nowhere but inside work_dir.
    overwrite = check_export_target(
        config.finetune.export_dir, replace_other=config.finetune.replace_export_dir
    )
    check_toy_data_path(config)
    model_config = prepare_model(config)

    def tokenizer_dir(dist_context: DistributedContext) -> Path:
        with dist_context.main_process_first():
            return tokenizer_directory(model_config)

    data = sft_data_provider(config.dataset, order=config.data, tokenizer_directory=tokenizer_dir)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model_config),
        task_provider=causal_lm_task,
        data_provider=data,
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        events=events,
    ).configure()
    with trainer:
        main_process = trainer.dist_context.is_main_process
        if main_process and not config.dataset.streaming:
            print(data.report.summary(data.source_name))  # streaming: printed after training
        # Resumed first: a config whose checkpoint already reached max_steps trains nothing, and
        # its "before" would be the trained model's loss, not the untrained one's.
        trainer.resume()
        finished = trainer.step >= trainer.total_steps
        before = None if finished else evaluate(trainer, data)
        trainer.train()  # refuses a checkpoint past max_steps; a finished one trains nothing
        after = evaluate(trainer, data)
        if main_process and config.dataset.streaming:
            print(
                f"so far (streaming, the samples read up to step {trainer.step} by this process): "
                f"{data.report.summary(data.source_name)}"
            )
        export = trainer.export(
            config.finetune.export_dir, overwrite=overwrite, replace_other=config.finetune.replace_export_dir
        )
    finished_at = trainer.step if finished else None
    return RunResult(before=before, after=after, export=export, finished_at=finished_at)


USAGE = "usage: train.py CONFIG.yaml  (e.g. examples/finetune-qwen3/config.yaml)"


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    try:
        config = FinetuneConfig.from_yaml(sys.argv[1])
    except ConfigFileError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    try:
        result = run(config)
    except ExportTargetError as e:
        print(f"{e} (finetune.replace_export_dir: true)", file=sys.stderr)
        sys.exit(2)
    except ToyDataPathError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    except DataError as e:  # a malformed file or sample, a tokenizer without a chat template
        print(f"bad data: {e}", file=sys.stderr)
        sys.exit(2)
    if result.finished_at is not None:
        # The checkpoint is exported again: the same weights, and an export a killed run never
        # finished is completed.
        print(
            f"already finished at step {result.finished_at}: nothing trained; held-out loss: "
            f"{_show(result.after)}"
        )
        print(f"exported the finished model again to {result.export}")
        return
    print(f"held-out loss before: {_show(result.before)}  after: {_show(result.after)}")
    print(f"exported to {result.export}")


def _show(loss: float | None) -> str:
    return "n/a (no held-out split, or pipeline or context parallel)" if loss is None else f"{loss:.4f}"


if __name__ == "__main__":
    main()
