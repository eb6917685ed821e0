"""``pad_token_id``: the embedding's padding row, as transformers' ``nn.Embedding(padding_idx=...)``.

The row gets no gradient (``test_family_conformance`` compares every gradient with transformers
on batches holding pad tokens) and a fresh initialization zeroes it, on any mesh.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from d9d.hf import DecoderCausalLM, LlamaConfig, parallelize_decoder
from d9d.mesh import DistributedContext, MeshParameters
from d9d.mesh.testing import run_distributed

PAD = 5
CONFIG = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "pad_token_id": PAD,
}


def _fresh_rows(mesh: dict[str, int]) -> tuple[float, float, int | None]:
    context = DistributedContext(MeshParameters(**mesh), device_type="cpu")
    try:
        with torch.device("meta"):
            model = DecoderCausalLM(LlamaConfig.model_validate(CONFIG), attention_backend="eager")
        parallelize_decoder(model, dist_context=context)
        model.to_empty(device="cpu")
        model.reset_parameters()
        embedding = model.model.embed_tokens
        assert embedding is not None
        weight = embedding.weight.detach()
        full = weight.full_tensor() if isinstance(weight, DTensor) else weight
        return float(full[PAD].abs().max()), float(full[PAD - 1].abs().max()), embedding.padding_idx
    finally:
        context.close()


@pytest.mark.parametrize(
    ("mesh", "padding_idx"),
    [
        ({}, [PAD]),  # one process
        ({"data_parallel_shard": 2}, [PAD, PAD]),  # FSDP: the whole vocabulary on each rank in forward
        ({"tensor_parallel": 2}, [PAD, None]),  # vocabulary-parallel: rank 0 holds rows 0-63
    ],
)
def test_fresh_padding_row_is_zero_and_named_in_the_local_rows(
    mesh: dict[str, int], padding_idx: list[int | None]
) -> None:
    results = run_distributed(_fresh_rows, mesh, world_size=max(1, sum(mesh.values())), timeout_s=120)
    for pad_row, other_row, _ in results:
        assert pad_row == 0 and other_row > 0
    assert [index for _, _, index in results] == padding_idx
