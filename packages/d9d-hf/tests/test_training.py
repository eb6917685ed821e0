"""HFModelProvider + CausalLMTask through d9d-loop on 4 CPU ranks equal one process.

Every layout trains 3 steps from a tiny transformers checkpoint and must report the losses of
the same job in one process (fp32). The pipeline run also exports; transformers loads the
export and gives the single-process model's logits.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from d9d.hf import (
    CausalLMTask,
    DecoderCausalLM,
    DecoderModel,
    HFModelProvider,
    PretrainedModelConfig,
    ScratchModelConfig,
    TokenBatch,
    TokenSample,
    causal_lm_task,
    parallelize_decoder,
)
from d9d.hf.qwen3 import Qwen3DenseConfig, Qwen3MoeConfig
from d9d.kernels.layers import MoELayer
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    BuildForwardInputsContext,
    ComputeLossContext,
    ForwardBackwardFinished,
    OptimizerStepFinished,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.mesh import DistributedContext, MeshParameters
from d9d.mesh.testing import run_distributed
from d9d.state_mappers import SafetensorsCheckpoint

SEQ = 16
STEPS = 3
PROBE = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))


class _Tokens:
    """16 rows of 16 tokens; odd rows pack two documents, even rows mask a 5-token prompt."""

    def __init__(self, *, identical: bool = False, documents: bool = True) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 128, (16, SEQ), generator=generator)
        self.identical = identical  # every row row 1: any split gives equal microbatches
        self.documents = documents  # False: no document_ids at all (one document per row)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> TokenSample:
        index = 1 if self.identical else index
        ids = self.ids[index]
        if not self.documents:
            return TokenSample(input_ids=ids, labels=ids.clone())
        if index % 2:
            documents = torch.tensor([0] * 6 + [1] * (SEQ - 6))
            return TokenSample(input_ids=ids, labels=ids.clone(), document_ids=documents)
        labels = ids.clone()
        labels[:5] = -100
        return TokenSample(input_ids=ids, labels=labels, document_ids=torch.zeros(SEQ, dtype=torch.int64))


def _train(
    directory: Path | ScratchModelConfig,
    mesh: dict[str, int],
    export: Path | None = None,
    *,
    clip: bool = True,
    export_initial: Path | None = None,
    microbatch_size: int = 2,
    identical_rows: bool = False,
    documents: bool = True,
    param_dtype: str | None = None,
    pipeline: str | dict[str, Any] | None = None,
    checkpoint_dir: Path | None = None,
    max_steps: int = STEPS,
    optimizer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh,
            "trainer": {
                "max_steps": max_steps,
                **(
                    {}
                    if checkpoint_dir is None
                    else {"checkpoint": {"directory": str(checkpoint_dir), "every_steps": 1}}
                ),
                "global_batch_size": 8,
                "microbatch_size": microbatch_size,
                "logging": {"progress_bar": False},
                "device": "cpu",
                "gradient_clipping": {"max_norm": 1.0 if clip else None},
                **(
                    {}
                    if pipeline is None
                    else {"pipeline": {"name": pipeline} if isinstance(pipeline, str) else pipeline}
                ),
            },
            "data": {"shuffle": False},
            "optimizer": optimizer or {"name": "adamw", "lr": 0.01, "weight_decay": 0.0},
        }
    )
    losses: list[float] = []
    grad_norms: list[float] = []
    model = (
        directory
        if isinstance(directory, ScratchModelConfig | PretrainedModelConfig)
        else PretrainedModelConfig(source=str(directory), attention_backend="eager", param_dtype=param_dtype)
    )
    provider = HFModelProvider(model)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Tokens(identical=identical_rows, documents=documents),
            collator=TokenBatch.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    with trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda event: losses.append(event.loss))
        trainer.events.subscribe(OptimizerStepFinished, lambda event: grad_norms.append(event.grad_norm))
        if export_initial is not None:
            trainer.export(export_initial)
        trainer.train()
        result: dict[str, Any] = {"losses": losses, "grad_norms": grad_norms}
        result["layers"] = [list(stage.layout.layers) for stage in trainer.model_stages]
        result["dtypes"] = sorted(
            {
                f"{kind}:{tensor.dtype}"
                for stage in trainer.model_stages
                for kind, tensors in (("param", stage.parameters()), ("buffer", stage.buffers()))
                for tensor in tensors
                if tensor.is_floating_point()
            }
        )
        result["expert_bias"] = [
            layer.router.expert_bias.clone()
            for stage in trainer.model_stages
            for layer in stage.modules()
            if isinstance(layer, MoELayer) and layer.router.expert_bias is not None
        ]
        if export is not None:
            trainer.export(export)
        if mesh == {}:
            model = trainer.model_stages[0]
            assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
            with torch.no_grad():
                result["logits"] = model.logits(PROBE)
    return result


_REFERENCES: dict[tuple[str, bool, bool], dict[str, Any]] = {}


def _reference(directory: Path, *, clip: bool = True, documents: bool = True) -> dict[str, Any]:
    key = (str(directory), clip, documents)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_distributed(
            functools.partial(_train, clip=clip, documents=documents),
            directory,
            {},
            world_size=1,
            timeout_s=120,
        )[0]
    return _REFERENCES[key]


LAYOUTS = [
    ("dense", {"data_parallel_shard": 4}),  # FSDP
    ("dense", {"data_parallel_replicate": 2, "data_parallel_shard": 2}),  # HSDP
    ("dense", {"tensor_parallel": 2, "data_parallel_shard": 2}),  # TP with sequence parallelism x FSDP
    ("dense", {"context_parallel_shard": 2, "data_parallel_shard": 2}),  # CP (packed rows, windows) x FSDP
    ("moe", {"expert_parallel": 2, "data_parallel_shard": 4}),  # EP inside FSDP, load-balancing loss on
]


@pytest.mark.parametrize(("checkpoint", "mesh"), LAYOUTS)
def test_layout_trains_to_the_single_process_losses(
    checkpoints: dict[str, Path], checkpoint: str, mesh: dict[str, int]
) -> None:
    directory = checkpoints[checkpoint]
    expected = _reference(directory)["losses"]
    results = run_distributed(_train, directory, mesh, world_size=4, timeout_s=180)
    assert len(expected) == STEPS
    for result in results:
        torch.testing.assert_close(result["losses"], expected, atol=2e-5, rtol=2e-5)


def test_context_parallel_on_unpacked_rows_trains_to_the_single_process_losses(
    checkpoints: dict[str, Path],
) -> None:
    # One document per row: the task passes the cut rows' positions without document ids, so
    # context parallelism attends without a mask (its flash path on GPU).
    directory = checkpoints["dense"]
    expected = _reference(directory, documents=False)["losses"]
    train = functools.partial(_train, documents=False)
    for result in run_distributed(
        train, directory, {"context_parallel_shard": 2}, world_size=2, timeout_s=180
    ):
        torch.testing.assert_close(result["losses"], expected, atol=2e-5, rtol=2e-5)


def test_pipeline_with_tied_embeddings_trains_and_exports_for_transformers(
    checkpoints: dict[str, Path], tmp_path: Path, helpers: Any
) -> None:
    # PP=2 x FSDP=2; the embedding and the LM head are two copies kept equal across stages.
    # Clipping on: the global norm counts the tied weight once, as one process does.
    reference = _reference(checkpoints["tied"])
    assert max(reference["grad_norms"]) > 1.0  # max_norm 1.0 really clips
    export = tmp_path / "export"
    mesh = {"pipeline_parallel": 2, "data_parallel_shard": 2}
    results = run_distributed(_train, checkpoints["tied"], mesh, export, world_size=4, timeout_s=180)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(result["grad_norms"], reference["grad_norms"], atol=1e-4, rtol=1e-4)
    assert (export / "tokenizer.json").exists() == (checkpoints["tied"] / "tokenizer.json").exists()
    hf = helpers.hf_model(export)
    with torch.no_grad():
        logits = hf(PROBE).logits
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("checkpoint", "mesh"),
    [
        ("dense", {"pipeline_parallel": 2}),  # the shape pass without document ids (no value reads)
        # MoE stages state their outputs (StageOutputMeta): routing cannot run on meta tensors
        ("moe", {"pipeline_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 2}),
    ],
)
def test_pipeline_without_document_ids_trains_to_the_single_process_losses(
    checkpoints: dict[str, Path], checkpoint: str, mesh: dict[str, int]
) -> None:
    directory = checkpoints[checkpoint]
    expected = _reference(directory, documents=False)
    world_size = 2 if mesh == {"pipeline_parallel": 2} else 4
    train = functools.partial(_train, documents=False)
    results = run_distributed(train, directory, mesh, world_size=world_size, timeout_s=180)
    assert len(expected["losses"]) == STEPS
    for result in results:
        torch.testing.assert_close(result["losses"], expected["losses"], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(result["grad_norms"], expected["grad_norms"], atol=1e-4, rtol=1e-4)


def test_task_weights_each_microbatch_by_its_target_tokens() -> None:
    ids = torch.arange(8).reshape(1, 8)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt: no loss on it
    built = CausalLMTask().build_forward_inputs(
        BuildForwardInputsContext(batch=TokenBatch(input_ids=ids, labels=labels), step=0)
    )
    # position t predicts token t + 1: targets 4..7 at positions 3..6, none at the last one
    assert built.state.targets.tolist() == [[-100, -100, -100, 4, 5, 6, 7, -100]]
    assert built.num_tokens == 8
    losses = torch.arange(8, dtype=torch.float32).reshape(1, 8) * (built.state.targets != -100)
    result = CausalLMTask().compute_loss(
        ComputeLossContext(pipeline_results=losses, state=built.state, microbatch_index=0, step=0)
    )
    assert result.loss.item() == pytest.approx((3 + 4 + 5 + 6) / 4)
    assert result.loss_weight == 4.0


def test_pipeline_from_scratch_starts_with_equal_tied_copies(tmp_path: Path) -> None:
    # PP=2, freshly initialized: the last stage's head takes the first stage's embedding before
    # step 1. The export of the initial values (the tied weight from the first stage) started in
    # one process must then train to the same losses and gradient norms.
    config = ScratchModelConfig.model_validate(
        {
            "config": {
                "model_type": "qwen3",
                "vocab_size": 128,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "num_hidden_layers": 2,
                "tie_word_embeddings": True,
            },
            "attention_backend": "eager",
        }
    )
    initial = tmp_path / "initial"
    mesh = {"pipeline_parallel": 2}
    results = run_distributed(
        functools.partial(_train, export_initial=initial), config, mesh, world_size=2, timeout_s=180
    )
    reference = run_distributed(_train, initial, {}, world_size=1, timeout_s=120)[0]
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(result["grad_norms"], reference["grad_norms"], atol=1e-4, rtol=1e-4)


def test_load_balancing_loss_weighs_the_same_for_any_number_of_microbatches(
    checkpoints: dict[str, Path],
) -> None:
    # Identical rows: 1, 2 or 4 microbatches of a batch of 8 are the same data, so the
    # (per-microbatch) load-balancing loss and every gradient must not change with the split.
    runs = [
        run_distributed(
            functools.partial(_train, microbatch_size=size, identical_rows=True),
            checkpoints["moe"],
            {},
            world_size=1,
            timeout_s=120,
        )[0]
        for size in (8, 4)
    ]
    for run in runs[1:]:
        torch.testing.assert_close(run["losses"], runs[0]["losses"], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(run["grad_norms"], runs[0]["grad_norms"], atol=1e-5, rtol=1e-5)


# One data-parallel rank with a bf16 compute dtype: nothing is sharded, so the recipe casts the
# parameters for each forward without FSDP and must train as the sharded layout does.
TINY_SCRATCH: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
}


TINY_MOE: dict[str, Any] = {
    **TINY_SCRATCH,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def _units(
    mesh: dict[str, int], checkpointing: bool = False, moe: bool = False, stored: torch.dtype = torch.float32
) -> tuple[bool, list[bool]]:
    context = DistributedContext(MeshParameters(**mesh), device_type="cpu")
    try:
        with torch.device("meta"):
            model = DecoderCausalLM(
                Qwen3MoeConfig.model_validate(TINY_MOE)
                if moe
                else Qwen3DenseConfig.model_validate(TINY_SCRATCH),
                attention_backend="eager",
                activation_checkpointing=checkpointing,
            ).to(stored)
        parallelize_decoder(model, dist_context=context, param_dtype=torch.bfloat16)
        return isinstance(model, FSDPModule), [
            isinstance(layer, FSDPModule) for layer in model.model.decoder_layers()
        ]
    finally:
        context.close()


def test_one_rank_casts_without_fsdp_and_several_ranks_wrap_each_layer() -> None:
    root, layers = run_distributed(_units, {}, world_size=1, timeout_s=120)[0]
    assert not root and layers == [False, False]  # cast per forward, no FSDP
    root, layers = run_distributed(_units, {}, True, world_size=1, timeout_s=120)[0]
    assert root and layers == [False, False]  # recomputed layers: one FSDP unit for the stage
    for root, layers in run_distributed(_units, {"data_parallel_shard": 2}, world_size=2, timeout_s=120):
        assert root and layers == [True, True]
    # experts too: FSDP on one rank would copy every expert weight and gradient each step
    root, layers = run_distributed(_units, {}, False, True, world_size=1, timeout_s=120)[0]
    assert not root and layers == [False, False]
    root, layers = run_distributed(_units, {}, True, True, world_size=1, timeout_s=120)[0]
    assert root and layers == [True, True]  # recomputed: per-layer units, never all experts at once
    # stored in the compute dtype already (bf16 master weights): nothing to cast, so no unit that
    # would gather a second copy of the stage, recomputed or not, dense or MoE
    for checkpointing, moe in [(True, False), (True, True), (False, False)]:
        root, layers = run_distributed(
            _units, {}, checkpointing, moe, torch.bfloat16, world_size=1, timeout_s=120
        )[0]
        assert not root and layers == [False, False]


@pytest.mark.parametrize("shape", [TINY_SCRATCH, TINY_MOE], ids=["dense", "moe"])
def test_one_rank_in_bf16_trains_as_two_sharded_ranks(shape: dict[str, Any]) -> None:
    config = ScratchModelConfig.model_validate(
        {"config": shape, "param_dtype": "bfloat16", "attention_backend": "eager"}
    )
    # (an explicit one-rank mesh: `_train` reads the logits, outside forward, only for `{}`)
    single = run_distributed(_train, config, {"data_parallel_shard": 1}, world_size=1, timeout_s=120)[0]
    sharded = run_distributed(_train, config, {"data_parallel_shard": 2}, world_size=2, timeout_s=180)
    assert len(single["losses"]) == 3
    for result in sharded:
        # bf16 compute, float32 master weights and reductions: only the summation order differs
        torch.testing.assert_close(result["losses"], single["losses"], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(result["grad_norms"], single["grad_norms"], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("shape", [TINY_SCRATCH, TINY_MOE], ids=["dense", "moe"])
def test_bf16_master_weights_train_close_to_float32_ones_on_one_and_two_ranks(
    shape: dict[str, Any], tmp_path: Path
) -> None:
    # bf16 parameters, gradients and (with stochastic rounding) AdamW updates: no float32 copy
    def config(master: str) -> ScratchModelConfig:
        return ScratchModelConfig.model_validate(
            {"config": shape, "param_dtype": "bfloat16", "master_dtype": master, "attention_backend": "eager"}
        )

    optimizer = {"name": "stochastic_adamw", "lr": 0.01, "weight_decay": 0.0}
    master32 = run_distributed(
        _train, config("float32"), {"data_parallel_shard": 1}, world_size=1, timeout_s=120, max_steps=6
    )[0]
    single = run_distributed(
        functools.partial(_train, optimizer=optimizer, max_steps=6, export=tmp_path / "export"),
        config("bfloat16"),
        {"data_parallel_shard": 1},
        world_size=1,
        timeout_s=120,
    )[0]
    sharded = run_distributed(
        functools.partial(_train, optimizer=optimizer, max_steps=6),
        config("bfloat16"),
        {"data_parallel_shard": 2},
        world_size=2,
        timeout_s=180,
    )
    assert "param:torch.bfloat16" in single["dtypes"] and "param:torch.float32" not in single["dtypes"]
    assert "buffer:torch.float32" in single["dtypes"], "buffers (rotary frequencies) keep their dtype"
    assert single["losses"][-1] < single["losses"][0], "bf16 master weights must learn"
    torch.testing.assert_close(single["losses"], master32["losses"], atol=0.05, rtol=0.02)
    for result in sharded:  # stochastic rounding draws differ per shard: close, not equal
        torch.testing.assert_close(result["losses"], single["losses"], atol=0.05, rtol=0.02)
    exported = SafetensorsCheckpoint(tmp_path / "export")
    assert {spec.dtype for spec in exported.specs.values()} == {torch.bfloat16}


def test_bf16_master_weights_refuse_another_compute_dtype() -> None:
    with pytest.raises(ValueError, match=r"master_dtype: bfloat16 .*param_dtype must be bfloat16 or unset"):
        ScratchModelConfig.model_validate(
            {"config": TINY_SCRATCH, "param_dtype": "float32", "master_dtype": "bfloat16"}
        )


def test_fsdp_prefetch_and_kept_last_layer_train_as_one_process() -> None:
    # Explicit prefetch and an unresharded last layer move all-gathers, not results; a bf16
    # reduction rounds the summed gradients (close to float32's, not equal).
    def config(**fsdp: Any) -> ScratchModelConfig:
        return ScratchModelConfig.model_validate(
            {"config": {**TINY_SCRATCH, "num_hidden_layers": 4}, "attention_backend": "eager", "fsdp": fsdp}
        )

    single = run_distributed(_train, config(), {"data_parallel_shard": 1}, world_size=1, timeout_s=120)[0]
    tuned = config(forward_prefetch=2, backward_prefetch=3, keep_last_layer_gathered=True)
    for result in run_distributed(_train, tuned, {"data_parallel_shard": 2}, world_size=2, timeout_s=180):
        torch.testing.assert_close(result["losses"], single["losses"], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(result["grad_norms"], single["grad_norms"], atol=2e-5, rtol=2e-5)
    rounded = config(reduce_dtype="bfloat16")
    for result in run_distributed(_train, rounded, {"data_parallel_shard": 2}, world_size=2, timeout_s=180):
        torch.testing.assert_close(result["losses"], single["losses"], atol=2e-2, rtol=2e-2)
        assert result["grad_norms"] != single["grad_norms"]  # the reduction did run in bf16


def test_fsdp_options_are_validated_at_load() -> None:
    with pytest.raises(ValueError, match=r"fsdp\.forward_prefetch"):
        ScratchModelConfig.model_validate({"config": TINY_SCRATCH, "fsdp": {"forward_prefetch": -1}})
    with pytest.raises(ValueError, match=r"fsdp\.reduce_dtype"):
        ScratchModelConfig.model_validate({"config": TINY_SCRATCH, "fsdp": {"reduce_dtype": "float16"}})


def test_pipeline_gives_the_last_stage_fewer_layers_for_its_head(tmp_path: Path) -> None:
    # 4 layers, the head weighs 2: stage 0 takes layers 0-2, stage 1 layer 3 and the head.
    config = ScratchModelConfig.model_validate(
        {
            "config": {**TINY_SCRATCH, "num_hidden_layers": 4},
            "attention_backend": "eager",
            "last_stage_weight": 2.0,
        }
    )
    initial = tmp_path / "initial"
    results = run_distributed(
        functools.partial(_train, export_initial=initial),
        config,
        {"pipeline_parallel": 2},
        world_size=2,
        timeout_s=180,
    )
    reference = run_distributed(_train, initial, {}, world_size=1, timeout_s=120)[0]
    assert [result["layers"] for result in results] == [[[0, 1, 2]], [[3]]]
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_in_bf16_hands_bf16_activations_on(tmp_path: Path, schedule: str) -> None:
    # FSDP mixed precision computes in bf16: the stage's announced output dtype must say so, or
    # the first stage refuses its own output (and the next stage waits for it forever on NCCL).
    config = ScratchModelConfig.model_validate(
        {
            "config": {**TINY_SCRATCH, "num_hidden_layers": 4},
            "attention_backend": "eager",
            "param_dtype": "bfloat16",
        }
    )
    initial = tmp_path / "initial"
    results = run_distributed(
        functools.partial(_train, export_initial=initial, pipeline=schedule),
        config,
        {"pipeline_parallel": 2},
        world_size=2,
        timeout_s=180,
    )
    reference = run_distributed(
        functools.partial(_train, param_dtype="bfloat16"),
        initial,
        {"data_parallel_shard": 1},
        world_size=1,
        timeout_s=120,
    )[0]
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], atol=2e-3, rtol=2e-3)


def test_zero_bubble_schedule_on_fsdp_stages_trains_as_one_process(tmp_path: Path) -> None:
    # bf16 compute with recomputed layers puts each stage under FSDP, sharded over two ranks here:
    # the split backward holds FSDP's gradient reduction back until the stage's last weight pass.
    config = ScratchModelConfig.model_validate(
        {
            "config": {**TINY_SCRATCH, "num_hidden_layers": 4},
            "attention_backend": "eager",
            "param_dtype": "bfloat16",
            "activation_checkpointing": True,
        }
    )
    initial = tmp_path / "initial"
    results = run_distributed(
        functools.partial(_train, export_initial=initial, pipeline="zbv"),
        config,
        {"pipeline_parallel": 2, "data_parallel_shard": 2},
        world_size=4,
        timeout_s=240,
    )
    reference = run_distributed(
        functools.partial(_train, param_dtype="bfloat16"),
        initial,
        {"data_parallel_shard": 1},
        world_size=1,
        timeout_s=120,
    )[0]
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], atol=2e-3, rtol=2e-3)


def test_dualpipev_overlaps_moe_stages_under_expert_parallelism_as_one_process(
    checkpoints: dict[str, Path],
) -> None:
    # DualPipeV runs each paired forward and backward interleaved, taking turns after each decoder
    # layer: the forward's expert all-to-alls and FSDP gathers go out between the backward's. Both
    # expert-parallel ranks of a stage issue them in the same order, or the losses would differ.
    directory = checkpoints["moe"]
    # one sample per microbatch on both sides: the load-balancing loss is taken per microbatch
    single = functools.partial(_train, documents=False, microbatch_size=1)
    expected = run_distributed(single, directory, {}, world_size=1, timeout_s=120)[0]
    schedule = {"name": "dualpipev", "overlap": True}
    train = functools.partial(_train, documents=False, pipeline=schedule, microbatch_size=1)
    mesh = {"pipeline_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 2}
    results = run_distributed(train, directory, mesh, world_size=4, timeout_s=240)
    for result in results:
        assert result["layers"] in ([[0], [3]], [[1], [2]])
        torch.testing.assert_close(result["losses"], expected["losses"], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(result["grad_norms"], expected["grad_norms"], atol=1e-4, rtol=1e-4)


_EXPERT_BIAS_SINGLE: list[dict[str, Any]] = []


@pytest.mark.parametrize(
    ("mesh", "world"),
    [
        ({"data_parallel_shard": 2}, 2),
        ({"expert_parallel": 2, "data_parallel_shard": 2}, 2),
        ({"pipeline_parallel": 2, "data_parallel_shard": 2}, 4),
    ],
    ids=["fsdp", "ep", "pp"],
)
def test_expert_bias_moves_alike_on_every_rank_and_as_one_process(mesh: dict[str, int], world: int) -> None:
    # Auxiliary-loss-free balancing: each step's token counts are summed over the stage's ranks,
    # so every replica holds the bias one process gets from the whole batch.
    config = ScratchModelConfig.model_validate(
        {"config": TINY_MOE, "attention_backend": "eager", "expert_bias_update_rate": 0.01}
    )
    if not _EXPERT_BIAS_SINGLE:  # one process: the same run for every layout
        _EXPERT_BIAS_SINGLE.append(run_distributed(_train, config, {}, world_size=1, timeout_s=120)[0])
    single = _EXPERT_BIAS_SINGLE[0]
    expected = torch.stack(single["expert_bias"])
    assert expected.shape == (2, 4) and expected.abs().sum() > 0  # it moved
    assert {round(v, 6) for v in expected.flatten().tolist()} <= {
        round(0.01 * k, 6) for k in range(-STEPS, STEPS + 1)
    }  # sign steps of 0.01
    results = run_distributed(_train, config, mesh, world_size=world, timeout_s=180)
    by_layer: dict[int, torch.Tensor] = {}
    for result in results:
        torch.testing.assert_close(result["losses"], single["losses"], atol=2e-5, rtol=2e-5)
        for layer, bias in zip(
            [i for layers in result["layers"] for i in layers], result["expert_bias"], strict=True
        ):
            torch.testing.assert_close(bias, expected[layer], atol=0, rtol=0)
            by_layer[layer] = bias
    assert sorted(by_layer) == [0, 1]


def test_expert_bias_starts_at_zero_from_a_checkpoint_and_is_not_exported(
    checkpoints: dict[str, Path], tmp_path: Path, helpers: Any
) -> None:
    config = PretrainedModelConfig(
        source=str(checkpoints["moe"]), attention_backend="eager", expert_bias_update_rate=0.01
    )
    export = tmp_path / "export"
    initial = tmp_path / "initial"
    result = run_distributed(
        functools.partial(_train, export_initial=initial), config, {}, export, world_size=1, timeout_s=120
    )[0]
    assert torch.stack(result["expert_bias"]).abs().sum() > 0
    for directory in (initial, export):  # the checkpoint's tensors only, as transformers reads them
        names = set(SafetensorsCheckpoint(directory).specs)
        assert names == set(SafetensorsCheckpoint(checkpoints["moe"]).specs)
    helpers.hf_model(export)  # loads strictly
    untrained = helpers.hf_model(initial)
    source = helpers.hf_model(checkpoints["moe"])
    for (name, got), expected in zip(
        untrained.state_dict().items(), source.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, expected, msg=name)


def test_expert_bias_needs_experts() -> None:
    config = ScratchModelConfig.model_validate(
        {"config": TINY_SCRATCH, "attention_backend": "eager", "expert_bias_update_rate": 0.01}
    )
    with pytest.raises(
        Exception, match="expert_bias_update_rate is set but the model has no mixture-of-experts"
    ):
        run_distributed(_train, config, {}, world_size=1, timeout_s=120)


def test_expert_bias_resumes_exactly(tmp_path: Path) -> None:
    config = ScratchModelConfig.model_validate(
        {"config": TINY_MOE, "attention_backend": "eager", "expert_bias_update_rate": 0.01}
    )
    mesh = {"data_parallel_shard": 2}
    # the uninterrupted run saves after every step (the last two kept); without its last
    # checkpoint, a resume starts from the one before and runs the last step again
    saving = functools.partial(_train, checkpoint_dir=tmp_path / "ckpt")
    uninterrupted = run_distributed(saving, config, mesh, world_size=2, timeout_s=180)
    shutil.rmtree(tmp_path / "ckpt" / f"step_{STEPS:09d}")
    for full, rest in zip(
        uninterrupted, run_distributed(saving, config, mesh, world_size=2, timeout_s=180), strict=True
    ):
        assert len(rest["losses"]) == 1  # only the last step ran again
        torch.testing.assert_close(rest["losses"], full["losses"][-1:], atol=0, rtol=0)
        for got, expected in zip(rest["expert_bias"], full["expert_bias"], strict=True):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
