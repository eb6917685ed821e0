"""load_module_state / save_module_state: single process, and FSDP-sharded on 4 CPU ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from d9d.mesh.testing import run_distributed
from d9d.state_mappers import (
    DistributeMapper,
    GatherMapper,
    RenameMapper,
    SafetensorsCheckpoint,
    StateMappingError,
    TensorSpec,
    identity_mapper_from_module,
    load_module_state,
    map_state_dict,
    save_module_state,
)


def _read_dir(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(directory / file))
    return out


def test_single_process_load_then_save_round_trips(layouts, tmp_path: Path) -> None:
    hf = layouts.hf_state(seed=7)
    layouts.write_sharded(hf, tmp_path / "hf", 3, index=True)
    model = layouts.fused_model()
    load_module_state(tmp_path / "hf", model, layouts.hf_to_fused_mapper())
    fused = layouts.fused_reference(hf)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fused[name]), name
    save_module_state(tmp_path / "back", model, layouts.fused_to_hf_mapper(), max_shard_size_bytes=1500)
    back = _read_dir(tmp_path / "back")
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_buffers_and_integer_tensors_round_trip_and_progress_is_quiet_off_a_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    source.train()
    source(torch.randn(8, 3))  # running statistics and the int64 batch counter move
    save_module_state(tmp_path / "ckpt", source, identity_mapper_from_module(source), show_progress=True)
    target = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    load_module_state(tmp_path / "ckpt", target, identity_mapper_from_module(target), show_progress=True)
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    assert int(target.state_dict()["1.num_batches_tracked"]) == 1
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "missing from the source: ['lm_head.weight']"),  # the checkpoint lacks a key
        ("unexpected", "unexpected in the source (no mapper consumes them): ['stray']"),  # an extra key
        ("shape", "'embed.weight': mapped float32[10, 7], target float32[10, 8]"),  # wrong shape
    ],
)
def test_load_rejects_bad_checkpoints_before_touching_the_module(
    layouts, tmp_path: Path, case: str, message: str
) -> None:
    hf = layouts.hf_state(seed=8)
    match case:
        case "missing":
            del hf["lm_head.weight"]
        case "unexpected":
            hf["stray"] = torch.zeros(1)
        case "shape":
            hf["model.embed_tokens.weight"] = torch.zeros(10, 7)
        case _:
            raise AssertionError(case)
    layouts.write_sharded(hf, tmp_path / "hf", 2, index=False)
    model = layouts.fused_model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(StateMappingError) as error:
        load_module_state(tmp_path / "hf", model, layouts.hf_to_fused_mapper())
    assert message in str(error.value)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


def test_save_rejects_a_mapper_that_does_not_fit_and_writes_nothing(layouts, tmp_path: Path) -> None:
    model = layouts.fused_model()
    with pytest.raises(StateMappingError, match="unexpected in the source"):
        save_module_state(tmp_path / "out", model, identity_mapper_from_module(torch.nn.Linear(2, 2)))
    assert list(tmp_path.iterdir()) == []


def _fsdp_model(layouts) -> torch.nn.Module:
    torch.manual_seed(100 + dist.get_rank())  # every rank starts from different values
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = layouts.fused_model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sharded_load_and_save(layouts, source: Path, target: Path, fused: dict[str, torch.Tensor]) -> int:
    model = _fsdp_model(layouts)
    checkpoint = SafetensorsCheckpoint(source)
    load_module_state(checkpoint, model, layouts.hf_to_fused_mapper(), show_progress=False)
    for name, param in model.state_dict().items():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
        assert torch.equal(param.full_tensor(), fused[name]), name
    save_module_state(target, model, layouts.fused_to_hf_mapper(), show_progress=False)
    return checkpoint.bytes_read


def test_fsdp_load_matches_full_load_and_distributed_save_round_trips(layouts, tmp_path: Path) -> None:
    hf = layouts.hf_state(seed=9)
    layouts.write_sharded(hf, tmp_path / "hf", 3, index=True)
    fused = layouts.fused_reference(hf)
    read = run_distributed(
        _sharded_load_and_save,
        layouts,
        tmp_path / "hf",
        tmp_path / "back",
        fused,
        world_size=4,
        timeout_s=180,
    )
    total = sum(t.numel() * t.element_size() for t in hf.values())
    # Shard(0) boxes are disjoint: together the ranks read the checkpoint exactly once,
    # each about a quarter of it (uneven vocab rows 3/3/3/1 make it not exactly a quarter).
    assert sum(read) == total
    assert max(read) <= 0.3 * total
    back = _read_dir(tmp_path / "back")
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)
    # Groups are shared out: every rank wrote its own file.
    files = sorted(p.name for p in (tmp_path / "back").glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _distribute_and_gather(full: torch.Tensor, source: Path) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    placements = (Shard(1), Shard(0))
    mapper = DistributeMapper("w", mesh, placements, target="d")
    (group,) = mapper.groups()
    plan = group.plan({"w": TensorSpec.of(full)}, {"d": ((0, full.shape[0]), (0, full.shape[1]))})
    reference = distribute_tensor(full, mesh, placements)
    (box,) = plan.input_boxes.values()
    # Each rank reads exactly its local shard's box.
    assert tuple(e - s for s, e in box) == tuple(reference.to_local().shape)
    out = map_state_dict(mapper, {"w": full})["d"]
    assert isinstance(out, DTensor) and out.placements == placements
    assert torch.equal(out.to_local(), reference.to_local())
    gathered = map_state_dict(GatherMapper("d", target="w"), {"d": out})["w"]
    assert not isinstance(gathered, DTensor) and torch.equal(gathered, full)
    replicated = map_state_dict(DistributeMapper("w", mesh, (Replicate(), Shard(1))), {"w": full})["w"]
    assert torch.equal(replicated.full_tensor(), full)
    # Loading into a 2-D sharded parameter reads exactly the local box (several strided runs).
    linear = torch.nn.Linear(7, 5, bias=False)
    linear.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 7), mesh, placements))
    checkpoint = SafetensorsCheckpoint(source)
    load_module_state(checkpoint, linear, RenameMapper("w", "weight"))
    assert torch.equal(linear.weight.to_local(), reference.to_local())
    assert checkpoint.bytes_read == reference.to_local().numel() * 4


def _replicated_save(target: Path) -> None:
    torch.manual_seed(0)  # the same plain (replicated) module on every rank
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    save_module_state(target, module, identity_mapper_from_module(module), process_group=dist.group.WORLD)


def test_distribute_gather_and_load_on_a_2d_mesh(tmp_path: Path) -> None:
    full = torch.arange(35.0).reshape(5, 7)  # uneven on both tensor dims
    save_file({"w": full}, tmp_path / "w.safetensors")
    run_distributed(_distribute_and_gather, full, tmp_path / "w.safetensors", world_size=4, timeout_s=180)


def test_replicated_module_saved_by_a_group_writes_each_tensor_once(tmp_path: Path) -> None:
    run_distributed(_replicated_save, tmp_path / "out", world_size=2, timeout_s=180)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).state_dict()
    saved = _read_dir(tmp_path / "out")
    assert set(saved) == set(reference) and all(torch.equal(saved[n], t) for n, t in reference.items())
    # Two ranks, each owning some groups: two files, no tensor in both.
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(files) == 2
    per_file = [set(load_file(f)) for f in files]
    assert per_file[0].isdisjoint(per_file[1])
