"""``model.float8``: which layers train in FP8, what is refused, numerics, FSDP, export.

torch's ``_scaled_mm`` runs on CPU, so dense FP8 training runs here for real (tiny shapes); the
FP8 grouped GEMM of MoE experts runs its CPU reference (the same quantization, float32 products).
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from d9d.hf import HFModelProvider, PretrainedModelConfig, TokenBatch, TokenSample, causal_lm_task
from d9d.kernels.layers import MoELayer
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ForwardBackwardFinished,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.mesh.testing import DistributedTestError, run_distributed
from d9d.parallel import Float8BaseLinear, Float8GroupedMatmul

float8_linear = pytest.importorskip(
    "torchao.float8.float8_linear", reason="torchao (the float8 extra) is not installed"
)

SEQ = 16
# every projection of the tiny checkpoints (hidden 64, heads 4x16, kv 2x16, mlp 96) is a multiple
# of 16; min_features 32 lets them all convert
FLOAT8 = {"recipe": "tensorwise", "min_features": 32}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class _Rows:
    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (16, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> TokenSample:
        return TokenSample(input_ids=self.ids[index], labels=self.ids[index].clone())


def _train(
    directory: Path,
    float8: dict[str, Any] | None,
    *,
    mesh: dict[str, int] | None = None,
    export: Path | None = None,
    peft: dict[str, Any] | None = None,
    steps: int = 3,
    options: dict[str, Any] | None = None,
    checkpoint_dir: Path | None = None,
    microbatch_size: int = 4,
) -> dict[str, Any]:
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh or {},
            "trainer": {
                "max_steps": steps,
                "global_batch_size": 8,
                "microbatch_size": microbatch_size,
                "logging": {"progress_bar": False},
                "device": "cpu",
                **({} if peft is None else {"peft": peft}),
                **(
                    {}
                    if checkpoint_dir is None
                    else {"checkpoint": {"directory": str(checkpoint_dir), "every_steps": 1}}
                ),
            },
            "data": {"shuffle": False},
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0},
        }
    )
    model_config = PretrainedModelConfig.model_validate(
        {
            "source": str(directory),
            "attention_backend": "eager",
            "param_dtype": "bfloat16",
            **({} if float8 is None else {"float8": float8}),
            **(options or {}),
        }
    )
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model_config),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Rows(), collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    losses: list[float] = []
    with trainer:
        model = trainer.model_stages[0]
        result: dict[str, Any] = {
            "float8": sorted(
                n for n, m in model.named_modules() if isinstance(m, float8_linear.Float8Linear)
            ),
            "state": {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()},
            "float8_base": sorted(
                n
                for n, m in model.named_modules()
                if isinstance(getattr(m, "base_linear", None), Float8BaseLinear)
            ),
            "matmuls": sorted(
                {type(m.experts.grouped_matmul).__name__ for m in model.modules() if isinstance(m, MoELayer)}
            ),
        }
        weight_casts = {
            id(casts): casts
            for m in model.modules()
            if isinstance(m, MoELayer)
            and isinstance(m.experts.grouped_matmul, Float8GroupedMatmul)
            and (casts := m.experts.grouped_matmul.weight_casts) is not None
        }
        trainer.events.subscribe(ForwardBackwardFinished, lambda event: losses.append(event.loss))
        trainer.train()
        result["losses"] = losses
        result["weight_casts"] = [(casts.hits, casts.misses, len(casts)) for casts in weight_casts.values()]
        result["moe_layers"] = sum(isinstance(m, MoELayer) for m in model.modules())
        if export is not None:
            trainer.export(export)
    return result


def _run(*args: Any, world_size: int = 1, **kwargs: Any) -> list[dict[str, Any]]:
    return run_distributed(_train, *args, world_size=world_size, timeout_s=240, **kwargs)


def _tensors(directory: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {k: (v.shape, v.dtype) for f in directory.glob("*.safetensors") for k, v in load_file(f).items()}


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def bf16(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The dense checkpoint trained in plain bf16 on one process (3 steps), once for every FP8 test;
    ``export`` is the directory of its export."""
    export = tmp_path_factory.mktemp("bf16") / "export"
    return {**_run(checkpoints["dense"], None, export=export)[0], "export": export}


# --- configuration ----------------------------------------------------------------------------


def test_rowwise_with_float8_all_gather_is_refused_at_configure_time() -> None:
    with pytest.raises(
        ValidationError, match=r"model.float8.fsdp_float8_all_gather needs model.float8.recipe"
    ):
        PretrainedModelConfig(source="x", float8={"recipe": "rowwise", "fsdp_float8_all_gather": True})  # pyright: ignore[reportArgumentType]


def test_per_step_expert_weight_casts_need_float8_experts() -> None:
    with pytest.raises(
        ValidationError, match=r"model.float8.expert_weight_casts: per_step needs model.float8.experts"
    ):
        PretrainedModelConfig(source="x", float8={"expert_weight_casts": "per_step"})  # pyright: ignore[reportArgumentType]


def test_float8_experts_need_bf16_compute() -> None:
    with pytest.raises(ValidationError, match=r"model.float8.experts needs model.param_dtype: bfloat16"):
        PretrainedModelConfig(source="x", float8={"experts": True})  # pyright: ignore[reportArgumentType]
    PretrainedModelConfig(source="x", param_dtype="bfloat16", float8={"experts": True})  # pyright: ignore[reportArgumentType]


def test_unknown_keys_and_bad_patterns_are_refused() -> None:
    with pytest.raises(ValidationError, match="recipe"):
        PretrainedModelConfig(source="x", float8={"recipe": "blockwise"})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValidationError, match="extra"):
        PretrainedModelConfig(source="x", float8={"scaling": "rowwise"})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValidationError, match="not a regular expression"):
        PretrainedModelConfig(source="x", float8={"exclude": ["("]})  # pyright: ignore[reportArgumentType]


def test_missing_torchao_is_named_at_configure_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ValidationError, match=r"model.float8 needs torchao.*d9d-hf\[float8\]"):
        PretrainedModelConfig(source="x", float8={})  # pyright: ignore[reportArgumentType]


# --- dense training on one process --------------------------------------------------------------


def test_float8_converts_the_projections_trains_close_to_bf16_and_exports_unchanged(
    checkpoints: dict[str, Path], tmp_path: Path, helpers: Any, bf16: dict[str, Any]
) -> None:
    directory = checkpoints["dense"]
    fp8 = _run(directory, FLOAT8, export=tmp_path / "fp8")[0]
    assert fp8["float8"] == sorted(f"model.layers.{i}.{p}" for i in range(3) for p in PROJECTIONS + MLP)
    assert bf16["float8"] == []
    assert fp8["state"] == bf16["state"]  # same names, shapes and (master) dtypes
    assert _relative(fp8["losses"], bf16["losses"]) < 0.05
    # the export: the same tensors under transformers' names, in the master dtype; transformers loads it
    assert _tensors(tmp_path / "fp8") == _tensors(bf16["export"])
    loaded = helpers.hf_model(tmp_path / "fp8")
    assert loaded(torch.randint(0, 128, (1, 8))).logits.isfinite().all()


def test_float8_with_activation_checkpointing_trains_close_to_bf16(
    checkpoints: dict[str, Path], bf16: dict[str, Any]
) -> None:
    # the recomputed forward in backward runs the converted layers again
    directory = checkpoints["dense"]
    result = _run(directory, FLOAT8, options={"activation_checkpointing": True})[0]
    assert len(result["float8"]) == 21
    assert _relative(result["losses"], bf16["losses"]) < 0.05


def test_exclude_keeps_chosen_layers_in_bf16(checkpoints: dict[str, Path]) -> None:
    result = _run(checkpoints["dense"], {**FLOAT8, "exclude": [r"\.self_attn\."]}, steps=1)[0]
    assert result["float8"] == sorted(f"model.layers.{i}.{p}" for i in range(3) for p in MLP)


def test_float8_converting_no_layer_is_refused_naming_the_filter(checkpoints: dict[str, Path]) -> None:
    # every layer of the tiny checkpoint is below the default 128 features: it trained in bf16
    # without a word
    source = checkpoints["dense"]
    with pytest.raises(
        DistributedTestError,
        match=rf"model.float8 converts no linear layer of {re.escape(str(source))} \(DecoderModel, "
        r"21 linear layers\): 0 match model.float8.exclude .*21 are below "
        r"model.float8.min_features=128 \(the widest has 64 features\).*Lower min_features, narrow exclude",
    ):
        _run(source, {}, steps=1)


@pytest.mark.parametrize("mesh", [{}, {"data_parallel_shard": 2}, {"tensor_parallel": 2}])
def test_float8_with_lora_runs_the_frozen_base_in_fp8(
    checkpoints: dict[str, Path], mesh: dict[str, int]
) -> None:
    # the adapted projections keep their LoRA layer (adapters in bf16) with an FP8 base product;
    # the other projections become torchao's float8 layers
    peft = {"kind": "lora", "target": r"q_proj|v_proj", "r": 4, "alpha": 8}
    world = 2 if mesh else 1
    adapted = sorted(f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "v_proj"))
    plain = _run(checkpoints["dense"], None, peft=peft, mesh=mesh, world_size=world)
    fp8_runs = _run(checkpoints["dense"], FLOAT8, peft=peft, mesh=mesh, world_size=world)
    for fp8, bf16 in zip(fp8_runs, plain, strict=True):
        assert fp8["float8_base"] == adapted
        assert len(fp8["float8"]) == 21 - 6
        assert fp8["state"] == bf16["state"]
        assert _relative(fp8["losses"], bf16["losses"]) < 0.05
        assert fp8["losses"] != bf16["losses"]


def test_float8_experts_with_lora_on_the_experts_is_refused(checkpoints: dict[str, Path]) -> None:
    peft = {"kind": "lora", "target": r"experts", "r": 4, "alpha": 8}
    with pytest.raises(DistributedTestError, match=r"model.float8.experts with LoRA on the experts"):
        _run(checkpoints["moe"], {**FLOAT8, "experts": True}, peft=peft, steps=1)


# --- distributed --------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh", [{"data_parallel_shard": 2}, {}])
def test_float8_all_gather_trains_close_to_bf16_and_exports_plain_tensors(
    checkpoints: dict[str, Path], tmp_path: Path, mesh: dict[str, int], bf16: dict[str, Any]
) -> None:
    # two FSDP ranks gather the weights in float8; one rank has nothing to gather (plain weights)
    directory = checkpoints["dense"]
    gathered = {**FLOAT8, "fsdp_float8_all_gather": True}
    world = 2 if mesh else 1
    for result in _run(directory, gathered, mesh=mesh, world_size=world, export=tmp_path / "fp8"):
        assert len(result["float8"]) == 21
        assert _relative(result["losses"], bf16["losses"]) < 0.05
    assert _tensors(tmp_path / "fp8") == _tensors(bf16["export"])


def test_float8_all_gather_resumes_from_a_checkpoint(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # DCP saves and loads the float8-gathered (torchao-wrapped) sharded weights; the resumed last
    # step equals the uninterrupted run's
    directory = checkpoints["dense"]
    gathered = {**FLOAT8, "fsdp_float8_all_gather": True}
    mesh = {"data_parallel_shard": 2}
    # the uninterrupted run saves after every step (the last two kept); without its last
    # checkpoint, a resume starts from step 2's and runs the last step again
    uninterrupted = _run(directory, gathered, mesh=mesh, world_size=2, checkpoint_dir=tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / "step_000000003")
    resumed = _run(directory, gathered, mesh=mesh, world_size=2, checkpoint_dir=tmp_path / "ckpt")
    for full, rest in zip(uninterrupted, resumed, strict=True):
        assert len(rest["losses"]) == 1  # only the last step ran again
        torch.testing.assert_close(rest["losses"], full["losses"][-1:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("mesh", "float8", "layers"),
    [
        ({"tensor_parallel": 2}, {**FLOAT8, "recipe": "rowwise"}, 21),
        ({"tensor_parallel": 2, "data_parallel_shard": 2}, {**FLOAT8, "fsdp_float8_all_gather": True}, 21),
        ({"pipeline_parallel": 2}, FLOAT8, None),  # each stage converts its own layers
    ],
)
def test_tensor_and_pipeline_parallel_with_float8_train_close_to_bf16(
    checkpoints: dict[str, Path],
    mesh: dict[str, int],
    float8: dict[str, Any],
    layers: int | None,
    bf16: dict[str, Any],
) -> None:
    directory = checkpoints["dense"]
    world = 1
    for degree in mesh.values():
        world *= degree
    results = _run(directory, float8, mesh=mesh, world_size=world)
    for result in results:
        if layers is not None:
            assert len(result["float8"]) == layers
        assert _relative(result["losses"], bf16["losses"]) < 0.05
    if layers is None:  # the two stages' layers together: all 21 projections
        assert sum(len(r["float8"]) for r in results) == 21


# --- MoE experts --------------------------------------------------------------------------------


def test_float8_experts_install_the_fp8_grouped_gemm(checkpoints: dict[str, Path]) -> None:
    # on CPU the FP8 grouped GEMM's reference runs: the same quantization, float32 products
    directory = checkpoints["moe"]
    plain = _run(directory, FLOAT8, steps=2)[0]
    assert plain["matmuls"] == ["function"]  # d9d-kernels' grouped_mm
    experts = _run(directory, {**FLOAT8, "experts": True}, steps=2)[0]
    assert experts["matmuls"] == ["Float8GroupedMatmul"]
    assert experts["state"] == plain["state"]
    assert _relative(experts["losses"], plain["losses"]) < 0.05
    assert experts["losses"] != plain["losses"]


@pytest.mark.parametrize("master_dtype", ["bfloat16", "float32"])
def test_per_step_expert_weight_casts_train_as_per_microbatch_ones(
    checkpoints: dict[str, Path], master_dtype: str
) -> None:
    # two microbatches per step: bf16 parameters are cast once per step (the second microbatch
    # reads the casts), float32 ones are cast to new bf16 tensors every forward (never kept);
    # either way the losses are those of casting in every microbatch, bit for bit
    directory = checkpoints["moe"]
    options = {"master_dtype": master_dtype}
    experts = {**FLOAT8, "experts": True}
    per_microbatch = _run(directory, experts, steps=3, options=options)[0]
    per_step = _run(directory, {**experts, "expert_weight_casts": "per_step"}, steps=3, options=options)[0]
    assert per_microbatch["weight_casts"] == []
    assert per_step["losses"] == per_microbatch["losses"]
    assert len(per_step["weight_casts"]) == 1  # one object for every layer
    hits, misses, kept = per_step["weight_casts"][0]
    # each forward looks up (gate, up) and down once per MoE layer; backward reads what forward saved
    lookups = 3 * 2 * 2 * per_step["moe_layers"]
    assert per_step["moe_layers"] == 3 and hits + misses == lookups
    assert kept == 0  # cleared after the last optimizer step (or dropped with their tensors)
    match master_dtype:
        case "bfloat16":
            assert misses == hits == lookups // 2  # cast in each step's first microbatch only
        case _:
            assert hits == 0


def test_per_step_expert_weight_casts_under_fsdp_hit_and_train_as_per_microbatch_ones(
    checkpoints: dict[str, Path],
) -> None:
    # FSDP gathers each layer's experts into the same unsharded tensors every microbatch (their
    # version counters kept): the casts are reused, and cleared after each optimizer step; each
    # rank runs two microbatches of 2 rows per step
    directory = checkpoints["moe"]
    run = {"mesh": {"data_parallel_shard": 2}, "world_size": 2, "steps": 3, "microbatch_size": 2}
    experts = {**FLOAT8, "experts": True}
    per_microbatch = _run(directory, experts, **run)
    per_step = _run(directory, {**experts, "expert_weight_casts": "per_step"}, **run)
    for cast_each_time, cast_once in zip(per_microbatch, per_step, strict=True):
        assert cast_once["losses"] == cast_each_time["losses"]
        hits, misses, kept = cast_once["weight_casts"][0]
        # misses: 3 steps x 3 MoE layers x (gate and up, down) in the first microbatch; hits: the second
        assert (hits, misses, kept) == (18, 18, 0)
