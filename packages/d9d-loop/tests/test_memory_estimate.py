"""The memory estimate's arithmetic on a tiny decoder, against numbers worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from d9d.loop.config._optimizer import AdamWConfig, HostOffloadConfig, SGDConfig, StochasticAdamWConfig
from d9d.loop.estimate import (
    LinearShape,
    MemoryFitError,
    MemoryJob,
    ModelMemoryShape,
    OptimizerMemory,
    check_fits,
    estimate_memory,
    format_table,
    optimizer_memory,
    summary_line,
)
from d9d.loop.estimate._activations import head_bytes, layer_forward_bytes, saved_per_layer_bytes
from d9d.loop.peft import LoRAConfig, NF4BaseConfig, PlainBaseConfig
from d9d.mesh import MeshParameters

# hidden 8, 2 layers, 2 query heads and 1 key/value head of 4, feed-forward 16, vocabulary 32.
# A layer: q 8x8=64, k 8x4=32, v 32, o 64, gate/up/down 8x16=128 each: 576 linear elements and
# 24 norm elements (2 H + 2 head_dim) = 600. The model: 2 x 600 + embedding 256 + head 256 +
# final norm 8 = 1720 elements.
LAYER_LINEARS = (
    ("self_attn.q_proj", 8, 8),
    ("self_attn.k_proj", 8, 4),
    ("self_attn.v_proj", 8, 4),
    ("self_attn.o_proj", 8, 8),
    ("mlp.gate_proj", 8, 16),
    ("mlp.up_proj", 8, 16),
    ("mlp.down_proj", 16, 8),
)
TINY = ModelMemoryShape(
    num_layers=2,
    hidden_size=8,
    vocab_size=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    ffn_width=16,
    layer_linears=tuple(
        LinearShape(name=f"model.layers.{{layer}}.{name}", in_features=i, out_features=o)
        for name, i, o in LAYER_LINEARS
    ),
    layer_other_parameters=24,
    head=LinearShape(name="lm_head", in_features=8, out_features=32),
    other_parameters=8,
    storage_bytes=2,
    compute_bytes=2,
    activation_checkpointing=True,
)
ADAMW_BF16 = OptimizerMemory(state_bytes=4)


def _job(**changes: object) -> MemoryJob:
    job = MemoryJob(model=TINY, sequence_length=4, optimizer=ADAMW_BF16)
    return replace(job, **changes)  # pyright: ignore[reportArgumentType]


def test_full_fine_tuning_counts_every_element_three_ways() -> None:
    (rank,) = estimate_memory(_job())
    assert rank.components["weights, frozen"] == 0
    assert rank.components["weights, trained"] == 1720 * 2
    assert rank.components["gradients"] == 1720 * 2
    assert rank.components["optimizer state"] == 1720 * 4
    assert rank.phase == "backward"


def test_lora_freezes_the_base_and_trains_only_adapters() -> None:
    # r=2 on q (2 x (8 + 8) = 32) and v (2 x (8 + 4) = 24): 56 per layer, 112 in all
    lora = LoRAConfig(target="q_proj|v_proj", r=2, alpha=4.0)
    (rank,) = estimate_memory(_job(peft=lora))
    assert rank.components["weights, frozen"] == 1720 * 2
    assert rank.components["weights, trained"] == 112 * 2
    assert rank.components["optimizer state"] == 112 * 4


def test_lora_trainable_pattern_trains_the_head_in_full() -> None:
    lora = LoRAConfig(target="q_proj", r=2, alpha=4.0, trainable="lm_head")
    (rank,) = estimate_memory(_job(peft=lora))
    assert rank.components["weights, frozen"] == (1720 - 256) * 2
    assert rank.components["weights, trained"] == (2 * 32 + 256) * 2


def test_fsdp_shards_weights_gradients_and_state() -> None:
    (rank,) = estimate_memory(_job(mesh=MeshParameters(data_parallel_shard=2)))
    assert rank.components["weights, trained"] == 1720
    assert rank.components["optimizer state"] == 1720 * 2


def test_pipeline_ranks_hold_their_layers_and_ends() -> None:
    # rank 0: layer 0 and the embedding; rank 1: layer 1, the final norm and the head
    first, last = estimate_memory(_job(mesh=MeshParameters(pipeline_parallel=2), microbatches_per_step=2))
    assert first.components["weights, trained"] == (600 + 256) * 2
    assert last.components["weights, trained"] == (600 + 8 + 256) * 2
    assert (first.layers, last.layers) == (range(0, 1), range(1, 2))


def test_layer_activations_follow_the_documented_formula() -> None:
    # per token: 2 bytes x (4 H + 3 Q + 3 KV + 3 F) = 2 x (32 + 24 + 12 + 48) = 232, plus one
    # float32 log-sum-exp per head (8): 240; 4 tokens: 960
    assert layer_forward_bytes(_job(), tokens=4, adapted=0) == 960
    assert saved_per_layer_bytes(_job(), tokens=4, adapted=0) == 4 * 2 * 8  # only the input
    without = _job(model=replace(TINY, activation_checkpointing=False))
    assert saved_per_layer_bytes(without, tokens=4, adapted=0) == 960
    lora = _job(peft=LoRAConfig(target="q_proj", r=2, alpha=4.0))
    assert layer_forward_bytes(lora, tokens=4, adapted=1) == 960 + 4 * 2 * 2


def test_backward_holds_the_recomputed_layer_and_its_transients() -> None:
    # recomputed layer 960, gradients of gate and up and of input and residual:
    # 4 tokens x 2 bytes x (2 x 16 + 3 x 8) = 448
    (rank,) = estimate_memory(_job())
    assert rank.components["layer in backward"] == 960 + 448
    assert rank.allocated == 1720 * 2 * 2 + 1720 * 4 + 960 + 448
    assert rank.slack == int(0.05 * rank.allocated)


def test_offloaded_moments_leave_two_staging_chunks_on_the_device() -> None:
    config = StochasticAdamWConfig(state_dtype="bfloat16", offload=HostOffloadConfig(chunk_mib=1))
    optimizer = optimizer_memory(config, storage_bytes=2)
    (rank,) = estimate_memory(_job(optimizer=optimizer))
    assert rank.components["optimizer state"] == 2 << 20


def test_moments_kept_on_the_device_by_resident_mib_count_as_device_memory() -> None:
    offload = HostOffloadConfig(chunk_mib=1, resident_mib=3)
    config = StochasticAdamWConfig(state_dtype="bfloat16", offload=offload)
    optimizer = optimizer_memory(config, storage_bytes=2)
    (rank,) = estimate_memory(_job(optimizer=optimizer))
    assert rank.components["optimizer state"] == 5 << 20  # two 1 MiB chunks and 3 MiB resident


@pytest.mark.parametrize(
    ("config", "storage", "expected"),
    [
        (AdamWConfig(), 4, 8),  # two moments in the parameters' float32
        (AdamWConfig(), 2, 4),  # two moments in bf16 master weights' dtype
        (SGDConfig(), 4, 0),  # no momentum: no state
        (SGDConfig(momentum=0.9), 2, 2),  # one momentum buffer
        (StochasticAdamWConfig(state_dtype="bfloat16"), 4, 4),  # its own state dtype
    ],
)
def test_optimizer_state_bytes_per_element(
    config: AdamWConfig | SGDConfig, storage: int, expected: int
) -> None:
    assert optimizer_memory(config, storage_bytes=storage).state_bytes == expected


def test_a_job_that_fits_passes_and_one_that_does_not_names_the_amount_and_a_switch() -> None:
    job = _job(model=replace(TINY, activation_checkpointing=False))
    (rank,) = estimate_memory(job)
    check_fits(job, rank.total)
    # on this tiny model LoRA r16 adapters outweigh the layers, and offload's 1 GiB of staging
    # chunks the state: sharding over 2 ranks fits
    with pytest.raises(
        MemoryFitError, match=r"over the device's .* by .* GiB; it would fit with: FSDP over 2"
    ):
        check_fits(job, rank.total - 1)


@pytest.mark.parametrize(
    ("base", "bits"),
    [
        (NF4BaseConfig(block_size=64, double_quant=False), 4.5),  # a float32 absmax per 64 weights
        (NF4BaseConfig(block_size=64), 4 + 8 / 64 + 32 / (256 * 64)),  # 8-bit absmax, float32 per 256
        (PlainBaseConfig(), None),  # stored like the rest
    ],
)
def test_the_configured_base_sets_the_adapted_weights_bits(
    base: NF4BaseConfig | PlainBaseConfig, bits: float | None
) -> None:
    assert _job(peft=LoRAConfig(target="q_proj", r=2, alpha=4.0, base=base)).base_bits == bits


def test_a_lora_job_over_the_device_is_told_of_the_4_bit_base() -> None:
    lora = LoRAConfig(target="q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj", r=1, alpha=2.0)
    job = _job(peft=lora)
    quantized = _job(peft=lora.model_copy(update={"base": NF4BaseConfig()}))
    (plain,), (nf4,) = estimate_memory(job), estimate_memory(quantized)
    assert nf4.components["weights, frozen"] < plain.components["weights, frozen"]
    with pytest.raises(MemoryFitError, match=r"a 4-bit base \(trainer.peft.base: \{kind: nf4\}\)"):
        check_fits(job, nf4.total)


def test_a_quantized_base_shrinks_only_the_adapted_weights() -> None:
    # q_proj (64 per layer, 128 in all) at 4.5 bits: 72 bytes; the other 1592 frozen stay bf16
    lora = LoRAConfig(target="q_proj", r=2, alpha=4.0)
    (rank,) = estimate_memory(_job(peft=lora, frozen_bits=4.5))
    assert rank.components["weights, frozen"] == 1592 * 2 + 72


def test_frozen_weights_larger_than_the_device_are_named() -> None:
    job = _job(peft=LoRAConfig(target="q_proj", r=2, alpha=4.0))
    with pytest.raises(MemoryFitError, match=r"the frozen weights alone need .* GiB, more than the device's"):
        check_fits(job, 1000)


def test_table_and_summary_name_every_component_and_rank() -> None:
    estimates = estimate_memory(_job(mesh=MeshParameters(pipeline_parallel=2), microbatches_per_step=2))
    table = format_table(estimates, device_bytes=1 << 30)
    for row in ("weights, frozen", "optimizer state", "LM head and loss", "with allocator slack", "fits"):
        assert row in table
    assert "rank 1" in table and "layers: rank 0: 0-0, rank 1: 1-1" in table
    assert summary_line(estimates).startswith("memory estimate: ")


def test_head_logits_follow_the_models_chunk_rule() -> None:
    # 100 tokens, vocabulary 32 in bf16: 64 bytes a logits row; beside it the final norm's output
    # and the hidden gradient (2 x 100 x 8 x 2) and float32 loss and log-sum-exp (8 x 100).
    rest = 2 * 100 * 8 * 2 + 8 * 100
    assert head_bytes(_job(), 100, head_trained=False) == 100 * 64 + rest, "no rule: all the logits"
    asked: list[tuple[int, int]] = []

    def rule(tokens: int, vocab: int) -> int:
        asked.append((tokens, vocab))
        return 7

    chunked = _job(model=replace(TINY, head_chunk_tokens=rule), mesh=MeshParameters(tensor_parallel=2))
    assert head_bytes(chunked, 100, head_trained=False) == 7 * 32 + rest
    assert asked == [(100, 16)], "the rule sees the tokens and the vocabulary rows on the rank"
