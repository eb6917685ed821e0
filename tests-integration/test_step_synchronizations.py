"""A training step waits for the GPU once: when it reads the step's figures.

Any other synchronizing CUDA call in a step (a blocking host-to-device copy of a Python number, an
``.item()``) holds the host until the GPU has run everything queued, and then leaves the GPU idle
while the host queues what follows. CUDA's sync debug mode reports each such call; this test
counts them per step of a small Qwen3 and Qwen3-MoE job (eager and compiled) after warm-up and
names where they came from.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from d9d.hf import HFModelProvider, ScratchModelConfig, TokenBatch, TokenSample, causal_lm_task
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ProjectConfig,
    StepStarted,
    TrainingConfigurator,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SEQ, BATCH, STEPS, WARMUP = 64, 4, 6, 3
COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "tie_word_embeddings": False,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3": {**COMMON, "model_type": "qwen3"},
    "qwen3_moe": {
        **COMMON,
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


class _RandomRows:
    def __len__(self) -> int:
        return STEPS * BATCH

    def __getitem__(self, index: int) -> TokenSample:
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(0, COMMON["vocab_size"], (SEQ,), generator=generator)
        return TokenSample(input_ids=ids, labels=ids.clone())


def _synchronizations_per_step(
    shape: dict[str, Any], *, compiled: bool, device: str = "cuda", read_figures: str = "after_step"
) -> dict[int, list[str]]:
    """Where each step after warm-up synchronized (``file:line`` of the Python caller), by step.

    A step counts from its ``StepStarted`` to the next one, so the last step (followed by the
    run's end) is left out.
    """
    config = ProjectConfig.model_validate(
        {
            "trainer": {
                "max_steps": STEPS,
                "global_batch_size": BATCH,
                "microbatch_size": BATCH // 2,  # two microbatches: accumulation in the step
                "logging": {"progress_bar": False, "read_figures": read_figures},
                "device": device,
                "gradient_clipping": {"max_norm": 1.0},
            },
            "optimizer": {"name": "adamw", "lr": 1e-4},
        }
    )
    model = ScratchModelConfig.model_validate(
        {
            "config": shape,
            "param_dtype": "bfloat16" if device == "cuda" else None,
            "compile": compiled,
            "attention_backend": "sdpa",
        }
    )
    sites: dict[int, list[str]] = {}
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")

        def on_step(event: StepStarted) -> None:
            synchronizing = [w for w in recorded if "synchronizing CUDA operation" in str(w.message)]
            recorded.clear()
            if event.step > WARMUP:
                sites[event.step - 1] = [f"{w.filename}:{w.lineno}" for w in synchronizing]
            if event.step == WARMUP and device == "cuda":
                torch.cuda.set_sync_debug_mode("warn")

        try:
            with TrainingConfigurator(
                mesh=config.mesh,
                parameters=config.trainer,
                model_provider=HFModelProvider(model),
                task_provider=causal_lm_task,
                data_provider=AutoDataProvider(
                    dataset_factory=lambda _ctx: _RandomRows(),
                    collator=TokenBatch.collate,
                    config=config.data,
                ),
                optimizer_provider=AutoOptimizerProvider(config.optimizer),
                lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
            ).configure() as trainer:
                trainer.events.subscribe(StepStarted, on_step)
                trainer.train()
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    return sites


def test_every_step_after_warm_up_is_observed() -> None:
    # The harness itself, on the CPU (no CUDA syncs to count): steps WARMUP .. STEPS - 2 are seen.
    sites = _synchronizations_per_step(SHAPES["qwen3"], compiled=False, device="cpu")
    assert sites == {step: [] for step in range(WARMUP, STEPS - 1)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("read_figures", ["after_step", "during_next_step"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_one_synchronization_per_step(family: str, compiled: bool, read_figures: str) -> None:
    # The figures' own wait is on an event behind a pinned copy, which the debug mode does not flag.
    sites = _synchronizations_per_step(SHAPES[family], compiled=compiled, read_figures=read_figures)
    assert sites, "no step after warm-up was observed"
    for step, where in sites.items():
        assert len(where) <= 1, f"step {step} synchronized {len(where)} times: {where}"
