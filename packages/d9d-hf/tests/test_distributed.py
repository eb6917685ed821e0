"""Multi-rank: an FSDP-sharded model loads each rank's slice; tied gradients summed across stages."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import d9d.hf
from d9d.hf import DecoderInputs, build_decoder, causal_lm_targets, load_weights, sum_tied_gradients
from d9d.hf.qwen3 import read_qwen3_config
from d9d.mesh.testing import run_distributed
from d9d.parallel import parallelize_fsdp
from d9d.state_mappers import SafetensorsCheckpoint


def _fsdp_load(directory) -> tuple[int, int]:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = build_decoder(read_qwen3_config(directory), "causal_lm")
    for layer in model.model.decoder_layers():
        parallelize_fsdp(layer, mesh=mesh)
    parallelize_fsdp(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.reset_buffers()
    reader = SafetensorsCheckpoint(directory)
    load_weights(model, reader, show_progress=False)

    reference = d9d.hf.load_pretrained(directory)
    expected = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), name
        torch.testing.assert_close(parameter.full_tensor(), expected[name], atol=0, rtol=0, msg=name)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    inputs = DecoderInputs(input_ids=ids, labels=causal_lm_targets(ids))
    with torch.no_grad():
        torch.testing.assert_close(model(inputs), reference(inputs), atol=1e-5, rtol=1e-5)
    total = sum(spec.nbytes for spec in reader.specs.values())
    return reader.bytes_read, total


def test_fsdp_sharded_load_reads_each_byte_once_and_matches(checkpoints) -> None:
    # MoE: expert tensors are stacked from per-expert files, each rank reading only its experts
    results = run_distributed(_fsdp_load, checkpoints["moe"], world_size=2, timeout_s=180)
    assert sum(read for read, _ in results) == results[0][1]


def _tied_sum() -> None:
    rank = dist.get_rank()
    weight = torch.nn.Parameter(torch.zeros(3, 2))
    weight.grad = torch.full((3, 2), float(rank + 1))
    sum_tied_gradients(weight, dist.group.WORLD)
    torch.testing.assert_close(weight.grad, torch.full((3, 2), 3.0))


def test_tied_gradients_are_summed_between_stages() -> None:
    run_distributed(_tied_sum, world_size=2)
