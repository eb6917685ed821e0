"""d9d fine-tuning: supervised fine-tuning of a Qwen3 causal LM on prompt/completion pairs.

Run:        uv run examples/finetune-qwen3/train.py examples/finetune-qwen3/config.yaml
Scale out:  set `mesh: {data_parallel_shard: 4}` and run
            torchrun --nproc-per-node 4 examples/finetune-qwen3/train.py config.yaml

The loss falls on completions only; pairs are packed into rows (attention stays within each
pair); a held-out split is evaluated before and after training; the model is exported as a
Hugging Face directory that transformers loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from sft_data import PackedRows, pack, read_pairs, split_pairs
from tokenizers import Tokenizer
from toy_setup import write_tiny_checkpoint, write_toy_pairs

from d9d.hf import (
    CausalLMTask,
    HFModelConfig,
    PretrainedModelConfig,
    ScratchModelConfig,
    TokenBatch,
    causal_lm_task,
    resolve_snapshot,
)
from d9d.hf.qwen3 import Qwen3Inputs, Qwen3ModelProvider
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    BuildForwardInputsContext,
    ConfigFileError,
    ProjectConfig,
    Trainer,
    TrainingConfigurator,
)
from d9d.mesh import DistributedContext


class FinetuneSection(BaseModel):
    """Where the data comes from and goes to.

    Attributes:
        work_dir: Generated toy data and tiny checkpoint live here.
        dataset: JSONL of prompt/completion pairs; None generates a toy set in ``work_dir``.
        sequence_length: Tokens per packed row.
        eval_fraction: Share of the pairs held out for evaluation.
        export_dir: Where the fine-tuned model is exported (replaced if it exists).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    work_dir: Path = Path("runs/finetune-qwen3")
    dataset: Path | None = None
    sequence_length: int = Field(default=64, ge=8)
    eval_fraction: float = Field(default=0.2, gt=0, lt=1)
    export_dir: Path = Path("runs/finetune-qwen3/export")


class FinetuneConfig(ProjectConfig):
    """The quickstart's sections plus ``model`` (None: a generated tiny Qwen3) and ``finetune``."""

    model: HFModelConfig | None = None
    finetune: FinetuneSection = FinetuneSection()


def prepare_sources(config: FinetuneConfig) -> tuple[HFModelConfig, Path]:
    """The model section and the dataset, generating the toy ones that are not given."""
    section = config.finetune
    dataset = section.dataset or section.work_dir / "toy_pairs.jsonl"
    if section.dataset is None and not dataset.exists():
        write_toy_pairs(dataset, seed=config.trainer.seed)
    if config.model is not None:
        return config.model, dataset
    checkpoint = section.work_dir / "tiny-qwen3"
    if not checkpoint.exists():
        texts = [f"{p.prompt} {p.completion}" for p in read_pairs(dataset)]
        write_tiny_checkpoint(checkpoint, texts=texts, seed=config.trainer.seed)
    return PretrainedModelConfig(source=str(checkpoint)), dataset


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


class SFTData:
    """The train and held-out rows, tokenized once the model (and so its tokenizer) is known."""

    def __init__(
        self, config: FinetuneConfig, model_config: HFModelConfig, provider: Qwen3ModelProvider, dataset: Path
    ) -> None:
        self._config = config
        self._model_config = model_config
        self._provider = provider
        self._dataset = dataset
        self.eval_rows = PackedRows([])

    def build(self, dist_context: DistributedContext) -> PackedRows:
        """A dataset factory for ``AutoDataProvider`` (runs after the model stages are built)."""
        with dist_context.main_process_first():
            directory = tokenizer_directory(self._model_config)
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        model = self._provider.model_config(dist_context)
        eos = model.eos_token_id[0] if isinstance(model.eos_token_id, list) else model.eos_token_id
        if eos is None:
            raise ValueError(f"{directory}/config.json names no eos_token_id")
        pad = eos if model.pad_token_id is None else model.pad_token_id
        section = self._config.finetune
        train, held_out = split_pairs(
            read_pairs(self._dataset), eval_fraction=section.eval_fraction, seed=self._config.trainer.seed
        )
        length = section.sequence_length
        self.eval_rows = PackedRows(pack(held_out, tokenizer, sequence_length=length, eos_id=eos, pad_id=pad))
        return PackedRows(pack(train, tokenizer, sequence_length=length, eos_id=eos, pad_id=pad))


@torch.no_grad()
def evaluate(trainer: Trainer, rows: PackedRows) -> float | None:
    """Mean completion-token loss over ``rows``, forward only (every rank runs all rows).

    None under pipeline or context parallelism, where one rank's forward is not the whole model.
    """
    mesh = trainer.dist_context.parameters
    if mesh.pipeline_parallel > 1 or mesh.context_parallel > 1 or len(rows) == 0:
        return None
    model = trainer.model_stages[0]
    device = trainer.dist_context.device
    task = CausalLMTask()
    total, count = 0.0, 0
    model.eval()
    for start in range(0, len(rows), 8):
        batch = TokenBatch.collate([rows[i] for i in range(start, min(start + 8, len(rows)))])
        built = task.build_forward_inputs(BuildForwardInputsContext(batch=batch, step=0))
        losses = model(_to(built.input, device), None)
        total += float(losses.sum())
        count += int((built.state.targets != -100).sum())
    model.train()
    return total / max(count, 1)


def _to(inputs: Qwen3Inputs, device: torch.device) -> Qwen3Inputs:
    def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(device)

    return Qwen3Inputs(
        input_ids=inputs.input_ids.to(device),
        labels=move(inputs.labels),
        document_ids=move(inputs.document_ids),
        position_ids=move(inputs.position_ids),
    )


def run(config: FinetuneConfig) -> tuple[float | None, float | None, Path]:
    """Fine-tunes and exports; returns the held-out loss before and after, and the export."""
    model_config, dataset = prepare_sources(config)
    provider = Qwen3ModelProvider(model_config)
    data = SFTData(config, model_config, provider, dataset)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=data.build, collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    with trainer:
        before = evaluate(trainer, data.eval_rows)
        trainer.train()
        after = evaluate(trainer, data.eval_rows)
        export = trainer.export(config.finetune.export_dir, overwrite=True)
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
    before, after, export = run(config)
    print(f"held-out loss before: {_show(before)}  after: {_show(after)}")
    print(f"exported to {export}")


def _show(loss: float | None) -> str:
    return "n/a (pipeline or context parallel)" if loss is None else f"{loss:.4f}"


if __name__ == "__main__":
    main()
