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
    ExportTargetError,
    ProjectConfig,
    Trainer,
    TrainingConfigurator,
    check_export_target,
)
from d9d.loop.data import DataFileError, SampleError, TokenDataProvider
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


def run(config: FinetuneConfig) -> tuple[float | None, float | None, Path]:
    """Fine-tunes and exports; returns the held-out loss before and after, and the export."""
    # Before any work: an export_dir holding the user's own files is refused, not emptied.
    overwrite = check_export_target(
        config.finetune.export_dir, replace_other=config.finetune.replace_export_dir
    )
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
    ).configure()
    with trainer:
        if trainer.dist_context.is_main_process and not config.dataset.streaming:
            print(data.report.summary(data.source_name))  # streaming: logged after each pass
        before = evaluate(trainer, data)
        trainer.train()
        after = evaluate(trainer, data)
        export = trainer.export(
            config.finetune.export_dir, overwrite=overwrite, replace_other=config.finetune.replace_export_dir
        )
    return before, after, export


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
        before, after, export = run(config)
    except ExportTargetError as e:
        print(f"{e} (finetune.replace_export_dir: true)", file=sys.stderr)
        sys.exit(2)
    except (DataFileError, SampleError) as e:
        print(f"bad data: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"held-out loss before: {_show(before)}  after: {_show(after)}")
    print(f"exported to {export}")


def _show(loss: float | None) -> str:
    return "n/a (no held-out split, or pipeline or context parallel)" if loss is None else f"{loss:.4f}"


if __name__ == "__main__":
    main()
