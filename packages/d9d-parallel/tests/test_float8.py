"""FP8 linear layers through torchao: which layers convert, what is refused, numerics, FSDP."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    Float8BaseLinear,
    Float8Training,
    MissingFloat8Error,
    convert_to_float8,
    float8_linear_names,
    parallelize_fsdp,
    precompute_float8_scales,
)

float8 = pytest.importorskip(
    "torchao.float8.float8_linear", reason="torchao (the float8 extra) is not installed"
)


class _Adapted(nn.Linear):
    """A subclass of nn.Linear standing in for a LoRA layer."""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(64, 64)
        self.up_proj = nn.Linear(64, 128, bias=False)
        self.down_proj = nn.Linear(128, 64, bias=False)
        self.odd = nn.Linear(64, 40)  # 40 is not a multiple of 16
        self.router = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q_proj(x) + self.down_proj(torch.relu(self.up_proj(x)))
        return h + self.odd(h).sum(-1, keepdim=True) + self.router(h).sum(-1, keepdim=True)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.small = nn.Linear(64, 16)  # below min_features=32
        self.lm_head = nn.Linear(64, 96, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x) + self.small(x).sum(-1, keepdim=True)


_CONFIG = Float8Training(min_features=32)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


_EXPECTED = [f"layers.{i}.{name}" for i in (0, 1) for name in ("q_proj", "up_proj", "down_proj")]


def test_converts_exactly_the_chosen_layers_by_name() -> None:
    model = _Model()
    assert float8_linear_names(model, _CONFIG) == _EXPECTED
    assert convert_to_float8(model, _CONFIG) == _EXPECTED
    converted = {name for name, m in model.named_modules() if isinstance(m, float8.Float8Linear)}
    assert converted == set(_EXPECTED)
    # left in high precision: the LM head, the router, a 40-wide and a 16-wide layer
    for name in ("lm_head", "small", "layers.0.router", "layers.1.odd"):
        assert type(model.get_submodule(name)) is nn.Linear


def test_exclude_patterns_and_min_features_choose_layers() -> None:
    model = _Model()
    config = Float8Training(exclude=(r"\.q_proj$",), min_features=16)
    names = float8_linear_names(model, config)
    assert "layers.0.q_proj" not in names
    assert {"lm_head", "small", "layers.0.router", "layers.0.up_proj"} <= set(names)
    assert "layers.0.odd" not in names  # alignment is not configurable


def test_conversion_keeps_state_dict_names_values_and_dtype() -> None:
    model = _Model().to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert_to_float8(model, _CONFIG)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype == torch.bfloat16
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)


def test_conversion_works_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = _Model()
    convert_to_float8(model, Float8Training(min_features=32, fsdp_float8_all_gather=True))
    assert isinstance(model.layers[0].q_proj, float8.Float8Linear)
    assert model.layers[0].q_proj.weight.is_meta


def test_rowwise_with_float8_all_gather_is_refused() -> None:
    with pytest.raises(ValueError, match="fsdp_float8_all_gather needs recipe='tensorwise'"):
        Float8Training(recipe="rowwise", fsdp_float8_all_gather=True)


def test_a_bad_exclude_pattern_is_refused() -> None:
    with pytest.raises(ValueError, match="not a regular expression"):
        Float8Training(exclude=("(",))


def test_a_linear_subclass_is_refused_unless_excluded() -> None:
    model = _Model()
    model.layers[0].q_proj = _Adapted(64, 64)
    with pytest.raises(ValueError, match=r"'layers.0.q_proj' is a _Adapted, a subclass of nn.Linear"):
        convert_to_float8(model, _CONFIG)
    assert not any(isinstance(m, float8.Float8Linear) for m in model.modules())  # nothing half done
    names = convert_to_float8(model, Float8Training(min_features=32, exclude=(r"layers\.0\.q_proj",)))
    assert "layers.0.q_proj" not in names and type(model.layers[0].q_proj) is _Adapted


class _SlotAdapted(nn.Linear):
    """A LoRA-like layer: the base product through a ``base_linear`` slot, plus a low-rank update."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n, bias=True)
        self.base_linear = nn.functional.linear
        self.lora_A = nn.Parameter(torch.randn(4, n) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(n, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_linear(x, self.weight, self.bias) + x @ self.lora_A.T @ self.lora_B.T


def test_an_adapted_layer_keeps_its_class_and_runs_its_base_in_float8() -> None:
    torch.manual_seed(0)
    reference = _Model()
    reference.layers[0].q_proj = _SlotAdapted(64)
    reference = reference.to(torch.bfloat16)
    for name, parameter in reference.named_parameters():
        parameter.requires_grad_("lora_" in name or not name.startswith("layers.0.q_proj"))
    model = copy.deepcopy(reference)
    names = convert_to_float8(model, _CONFIG)
    adapted = model.layers[0].q_proj
    assert "layers.0.q_proj" in names and type(adapted) is _SlotAdapted
    assert isinstance(adapted.base_linear, Float8BaseLinear)
    assert model.state_dict().keys() == reference.state_dict().keys()  # nothing registered on the layer
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    out, ref = model(x), reference(x)
    out.float().square().mean().backward()
    ref.float().square().mean().backward()
    assert _relative(out, ref) < 0.1
    assert adapted.weight.grad is None  # the frozen base gets no gradient
    for name in ("lora_A", "lora_B"):
        got, want = getattr(adapted, name).grad, getattr(reference.layers[0].q_proj, name).grad
        assert got is not None and want is not None and _relative(got, want) < 0.2, name
    with pytest.raises(ValueError, match="already runs its base product in float8"):
        convert_to_float8(model, _CONFIG)


def test_converting_twice_is_refused() -> None:
    model = _Model()
    convert_to_float8(model, _CONFIG)
    with pytest.raises(ValueError, match="already a Float8Linear"):
        convert_to_float8(model, _CONFIG)


def test_missing_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(MissingFloat8Error, match=r"d9d-parallel\[float8\]"):
        convert_to_float8(_Model(), _CONFIG)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_forward_and_backward_are_close_to_bf16(recipe: str) -> None:
    torch.manual_seed(0)
    reference = _Model().to(torch.bfloat16)
    model = copy.deepcopy(reference)
    convert_to_float8(
        model, Float8Training(recipe="rowwise" if recipe == "rowwise" else "tensorwise", min_features=32)
    )
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    out, ref = model(x), reference(x)
    out.float().square().mean().backward()
    ref.float().square().mean().backward()

    assert _relative(out, ref) < 0.1
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert _relative(p.grad, q.grad) < 0.2, name
    assert _relative(out, torch.randn_like(ref)) > 1  # the bound means something


def _fsdp_float8(recipe: str) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp_shard",))
    gather = recipe == "tensorwise"
    config = Float8Training(
        recipe="tensorwise" if gather else "rowwise", min_features=32, fsdp_float8_all_gather=gather
    )
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 10))
    model = copy.deepcopy(reference)
    assert convert_to_float8(reference, config) == convert_to_float8(model, config) == ["0", "2"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            parallelize_fsdp(layer, mesh=mesh)
    parallelize_fsdp(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    gathered_in_float8 = {
        name
        for name, p in model.named_parameters()
        if isinstance(p, DTensor) and type(p.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
    }
    assert gathered_in_float8 == ({"0.weight", "2.weight"} if gather else set())
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-4) for m in (model, reference)]
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(2 * world, 8, 64)
        # dynamic scales come from the tensors a rank sees: the reference runs the ranks' halves
        for chunk in x.chunk(world):
            (reference(chunk).square().mean() / world).backward()
        model(x.chunk(world)[dist.get_rank()]).square().mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        precompute_float8_scales(model)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(p, DTensor)
        torch.testing.assert_close(
            p.full_tensor(), q.detach(), rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp_float8_matches_one_process(recipe: str) -> None:
    # tensorwise with float8 all-gather of the sharded weights; rowwise gathers bf16/fp32
    run_distributed(_fsdp_float8, recipe, world_size=2, timeout_s=180)
