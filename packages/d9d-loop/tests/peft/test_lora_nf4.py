"""LoRA on a 4-bit NF4 base (``peft.base: {kind: nf4}``, bitsandbytes): the layer equals a plain
LoRA layer whose base weight is the dequantized one (forward and gradients), a job trains on it and
exports the merged model, and every combination it cannot serve is refused before loading."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from loop_toy_job import Input, ToyTask, collate
from lora_wide_job import WideDataset, WideModel, WideProvider, run_wide, wide_config, write_base_model
from pydantic import ValidationError
from safetensors.torch import load_file
from torch import nn

from d9d._loop_command import main
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    LoadModelStageContext,
    LoadModelStageResult,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    ProjectConfig,
    Trainer,
    TrainingConfigurator,
)
from d9d.loop._optional_import import MissingExtraError
from d9d.loop.peft import (
    LoRAConfig,
    LoRALinear,
    NF4BaseConfig,
    NF4Weight,
    inject_lora,
    quantize_bases,
    refuse_quantized_base_on_mesh,
)
from d9d.mesh import MeshParameters
from d9d.mesh.testing import run_distributed
from d9d.state_mappers import identity_mapper_from_module

QLORA: dict[str, Any] = {"kind": "lora", "target": "fc1|fc2", "r": 2, "alpha": 4.0, "base": {"kind": "nf4"}}


def _another_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w, b)


class _NamedExport(WideProvider):
    """Exports under the plain model's names (a 4-bit LoRA layer has no ``weight`` parameter)."""

    def __init__(self, *, fp8: bool = False) -> None:
        self._fp8 = fp8
        self.loads = 0  # how often the stage's weights were loaded

    def load_model_stage(self, context: LoadModelStageContext[WideModel]) -> LoadModelStageResult:
        self.loads += 1
        return LoadModelStageResult(loaded=False)  # then reset_parameters() initializes

    def parallelize_model_stage(self, context: ParallelizeModelStageContext[WideModel]) -> None:
        super().parallelize_model_stage(context)
        if self._fp8:  # what d9d-parallel's convert_to_float8 does to a LoRA layer: a new base product
            for module in context.model.modules():
                if isinstance(module, LoRALinear):
                    module.base_linear = _another_product

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext[WideModel]
    ) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(state_mapper=identity_mapper_from_module(WideModel()))


def _trainer(config: ProjectConfig, provider: WideProvider | None = None) -> Trainer:
    return TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider or _NamedExport(),
        task_provider=lambda ctx: ToyTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: WideDataset(), collator=collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()


def _two_layers(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 96, bias=False)).to(dtype)
    with torch.no_grad():  # roughly a trained weight's distribution (NF4 is made for normal weights)
        for layer in (model[0], model[2]):
            layer.weight.normal_(0, 0.05)
    return model


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [
        (torch.float32, 1e-6),  # the base product runs in float32 on the dequantized weight
        (torch.bfloat16, 1e-2),  # bf16 compute, as on the GPU (bf16 rounding of the products)
    ],
)
def test_a_4bit_lora_layer_equals_plain_lora_on_its_dequantized_weight(
    dtype: torch.dtype, tolerance: float
) -> None:
    config = LoRAConfig.model_validate(QLORA | {"target": "0|2", "alpha": 8.0})
    quantized = _two_layers(dtype)
    inject_lora(quantized, config)
    quantized.load_state_dict(_two_layers(dtype).state_dict(), strict=False)
    with torch.no_grad():  # nonzero adapters, so the update is part of the comparison
        for layer in (quantized[0], quantized[2]):
            assert isinstance(layer, LoRALinear)
            layer.lora_B.normal_(0, 0.1)
    reference = copy.deepcopy(quantized)
    report = quantize_bases(quantized, config, torch.device("cpu"))
    assert report is not None and report.layers == 2
    for name in ("0", "2"):
        layer, plain = quantized.get_submodule(name), reference.get_submodule(name)
        assert isinstance(layer, LoRALinear) and isinstance(plain, LoRALinear)
        assert isinstance(layer.quantized, NF4Weight)
        assert "weight" not in dict(layer.named_parameters())  # the dense weight is gone
        with torch.no_grad():
            plain.weight.copy_(layer.base_weight())  # the reference: the dequantized base

    x = torch.randn(6, 64, dtype=dtype, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = quantized(x1), reference(x2)
    torch.testing.assert_close(y1, y2, atol=tolerance, rtol=tolerance)
    (y1.float().square().sum()).backward()
    (y2.float().square().sum()).backward()
    assert x1.grad is not None and x2.grad is not None
    torch.testing.assert_close(x1.grad, x2.grad, atol=tolerance * 10, rtol=tolerance)
    for (name, p1), (_, p2) in zip(
        ((n, p) for n, p in quantized.named_parameters() if p.requires_grad),
        ((n, p) for n, p in reference.named_parameters() if p.requires_grad),
        strict=True,
    ):
        assert p1.grad is not None and p2.grad is not None, name
        torch.testing.assert_close(p1.grad, p2.grad, atol=tolerance * 10, rtol=tolerance, msg=name)


def _squares(tensor: torch.Tensor) -> float:
    return float(tensor.float().square().sum())


def test_the_quantization_report_states_size_and_error() -> None:
    model = _two_layers(torch.bfloat16)
    config = LoRAConfig.model_validate(QLORA | {"target": "0|2"})
    inject_lora(model, config)
    model.load_state_dict(_two_layers(torch.bfloat16).state_dict(), strict=False)
    dense = {n: model.get_submodule(n).weight.detach().clone() for n in ("0", "2")}
    report = quantize_bases(model, config, torch.device("cpu"))
    assert report is not None
    assert report.dense_bytes == 2 * (64 * 128 + 128 * 96)
    # 4 bits per weight, one 8-bit scale per 64 weights, one float32 per 256 scales
    numel = 64 * 128 + 128 * 96
    assert report.quantized_bytes == numel // 2 + numel // 64 + 4 * 2  # each layer: under 256 scales
    error = sum(_squares(model.get_submodule(n).base_weight() - w) for n, w in dense.items())
    expected = (error / sum(_squares(w) for w in dense.values())) ** 0.5
    assert report.relative_error == pytest.approx(expected, rel=1e-2)
    assert 0.05 < report.relative_error < 0.12  # NF4 on normal weights: about 9 %


def test_a_job_trains_on_a_4bit_base_and_exports_the_dequantized_base_plus_adapters(tmp_path: Path) -> None:
    write_base_model(tmp_path / "base")
    config = wide_config(max_steps=3, peft=QLORA, initialization={"source": str(tmp_path / "base")})
    with _trainer(config) as trainer:
        model = trainer.model_stages[0]
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {
            "fc1.lora_A",
            "fc1.lora_B",
            "fc2.lora_A",
            "fc2.lora_B",
        }
        dequantized = {n: model.get_submodule(n).base_weight().detach().clone() for n in ("fc1", "fc2")}
        trainer.train()
        trainer.export(tmp_path / "export")
        model.eval()
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            y = model(Input(x=x), None)
            adapters = {
                n: (model.get_submodule(n).lora_A.clone(), model.get_submodule(n).lora_B.clone())
                for n in ("fc1", "fc2")
            }

    merged: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "export").glob("*.safetensors")):
        merged.update(load_file(file))
    original = load_file(next((tmp_path / "base").glob("*.safetensors")))
    assert set(merged) == set(original)  # the plain model's tensors, nothing quantized
    for name in ("fc1", "fc2"):
        a, b = adapters[name]
        assert b.abs().max() > 0  # the adapters trained
        torch.testing.assert_close(merged[f"{name}.weight"], dequantized[name] + 2.0 * b @ a)
        bf16_merge = original[f"{name}.weight"] + 2.0 * b @ a
        assert (merged[f"{name}.weight"] - bf16_merge).norm() / bf16_merge.norm() < 0.15  # 4-bit base
    plain = WideModel()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(Input(x=x), None), y, rtol=1e-5, atol=1e-6)


def _run_from(base: str, directory: str | None, max_steps: int) -> dict[str, Any]:
    trainer: dict[str, Any] = {"peft": QLORA | {"dropout": 0.1}, "initialization": {"source": base}}
    if directory is not None:
        trainer["checkpoint"] = {"directory": directory, "every_steps": 2, "keep_last": 5}
    return run_wide(wide_config(max_steps=max_steps, **trainer))


def test_a_4bit_lora_checkpoint_holds_the_adapters_only_and_resumes_exactly(tmp_path: Path) -> None:
    # a resume loads and quantizes the base again: the same codes, so the same steps bit for bit
    write_base_model(tmp_path / "base")
    base, run = str(tmp_path / "base"), str(tmp_path / "run")
    reference = run_distributed(_run_from, base, None, 4, world_size=1)[0]
    first = run_distributed(_run_from, base, run, 2, world_size=1)[0]  # stops at its checkpoint
    resumed = run_distributed(_run_from, base, run, 4, world_size=1)[0]
    assert first["losses"] + resumed["losses"] == reference["losses"]
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    saved = dcp.FileSystemReader(str(tmp_path / "run" / "step_000000002")).read_metadata()
    assert {k for k in saved.state_dict_metadata if k.startswith("model.")} == {
        "model.fc1.lora_A",
        "model.fc1.lora_B",
        "model.fc2.lora_A",
        "model.fc2.lora_B",
    }


@pytest.mark.parametrize(
    ("trainer", "mesh", "fp8", "message"),
    [
        # full fine-tuning would train the 4-bit weights
        ({"peft": {"kind": "full", "base": {"kind": "nf4"}}}, {}, False, "needs peft.kind: lora"),
        # an adapters-only export would pair the adapters with the bf16 base they were not trained on
        ({"peft": QLORA | {"export": "adapters"}}, {}, False, "peft.export=adapters"),
        # tensor parallelism would split the 4-bit weights
        ({"peft": QLORA}, {"tensor_parallel": 2}, False, "mesh.tensor_parallel=2"),
        # FSDP over two data-parallel ranks would shard them
        ({"peft": QLORA}, {"data_parallel_shard": 2}, False, "mesh.data_parallel_shard=2"),
        # FP8 replaces the base product the 4-bit weight computes
        ({"peft": QLORA}, {}, True, "FP8 (model.float8): layer 'fc1'"),
        # a trained base weight cannot be 4-bit
        ({"peft": QLORA | {"trainable": "fc2"}}, {}, False, "peft.trainable matches 'fc2.weight'"),
    ],
)
def test_what_a_4bit_base_cannot_serve_is_refused_before_loading(
    trainer: dict[str, Any], mesh: dict[str, int], fp8: bool, message: str
) -> None:
    provider = _NamedExport(fp8=fp8)

    def configure() -> None:
        _trainer(wide_config(max_steps=1, mesh=mesh, **trainer), provider).close()

    with pytest.raises((ValueError, ValidationError), match=re.escape(message)):
        configure()
    assert provider.loads == 0


def test_d9d_export_of_a_4bit_checkpoint_without_merging_is_refused_before_reading_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    peft = QLORA | {"export": "adapters"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"seed": 0, "peft": peft}}))
    checkpoint = tmp_path / "step_000000002"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(b"")  # never read: the config is refused first
    argv = ["export", str(tmp_path / "config.yaml"), str(checkpoint), str(tmp_path / "out")]
    # (any provider: the config is refused before one is built)
    assert main([*argv, "--provider", "test_cli_commands:toy_provider"]) == 2
    assert "peft.export=adapters with peft.base: {kind: nf4}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_missing_bitsandbytes_names_the_quant_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    config = LoRAConfig.model_validate(QLORA)
    with pytest.raises(MissingExtraError, match=re.escape("pip install 'd9d-loop[quant]'")):
        refuse_quantized_base_on_mesh(MeshParameters(), config)


def test_nf4_settings_are_validated() -> None:
    assert NF4BaseConfig().block_size == 64 and NF4BaseConfig().double_quant
    with pytest.raises(ValidationError, match="block_size"):
        NF4BaseConfig.model_validate({"kind": "nf4", "block_size": 48})
