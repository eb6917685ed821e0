"""Pipeline stages: each builds and loads only its part; chained, they are the whole model."""

from __future__ import annotations

import pytest
import torch

import d9d.hf
from d9d.hf import (
    DecoderCausalLM,
    DecoderInputs,
    DecoderModel,
    build_decoder,
    causal_lm_targets,
    load_weights,
)
from d9d.hf.qwen3 import read_qwen3_config
from d9d.pipeline import PipelineStageInfo
from d9d.state_mappers import SafetensorsCheckpoint


def _load(directory, checkpoint=None, **kwargs) -> DecoderModel:
    with torch.device("meta"):
        model = build_decoder(read_qwen3_config(directory), "causal_lm", **kwargs)
    model.to_empty(device="cpu")
    model.reset_buffers()
    load_weights(model, checkpoint or directory, show_progress=False)
    assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
    return model


def _inputs() -> DecoderInputs:
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(5))
    return DecoderInputs(input_ids=ids, labels=causal_lm_targets(ids))


def test_two_stages_hold_their_parts_read_their_bytes_and_chain_to_the_whole(checkpoints) -> None:
    directory = checkpoints["moe_aux"]  # output_router_logits: the load-balancing loss is in the objective
    readers = [SafetensorsCheckpoint(directory) for _ in range(2)]
    stages = [
        _load(directory, readers[i], stage=PipelineStageInfo(current_stage=i, num_stages=2)) for i in range(2)
    ]
    names = [set(dict(stage.named_parameters())) for stage in stages]
    assert "model.embed_tokens.weight" in names[0] and "model.embed_tokens.weight" not in names[1]
    assert "lm_head.weight" in names[1] and "lm_head.weight" not in names[0]
    assert "model.norm.weight" in names[1] and "model.norm.weight" not in names[0]
    assert list(stages[0].model.layers) == ["0", "1"] and list(stages[1].model.layers) == ["2", "3"]
    # together the stages read the checkpoint once
    total = sum(spec.nbytes for spec in readers[0].specs.values())
    assert readers[0].bytes_read + readers[1].bytes_read == total

    whole = d9d.hf.load_pretrained(directory)
    inputs = _inputs()
    handoff = stages[0](inputs)
    # the MoE's routing statistics travel with the activations: the last stage pools every layer's
    assert isinstance(handoff, dict)
    assert set(handoff) == {"hidden_states", "position_ids", "labels", "load_balancing_statistics"}
    torch.testing.assert_close(stages[1](handoff), whole(inputs), atol=1e-6, rtol=1e-6)


def test_explicit_layer_range() -> None:
    from d9d.hf.qwen3 import Qwen3DenseConfig

    config = Qwen3DenseConfig(
        model_type="qwen3",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
    )
    with torch.device("meta"):
        model = DecoderCausalLM(
            config, stage=PipelineStageInfo(current_stage=1, num_stages=3), layers=range(1, 4)
        )
    assert list(model.model.layers) == ["1", "2", "3"]
    assert model.lm_head is None and model.model.embed_tokens is None
    with pytest.raises(ValueError, match="contiguous part"):
        DecoderCausalLM(config, layers=range(2, 6))


def test_tied_head_on_the_last_stage_loads_the_embedding(checkpoints) -> None:
    directory = checkpoints["tied"]
    last = _load(directory, stage=PipelineStageInfo(current_stage=1, num_stages=2))
    whole = d9d.hf.load_pretrained(directory)
    assert last.lm_head is not None
    assert whole.lm_head.weight is whole.model.embed_tokens.weight  # one parameter when one stage holds both
    torch.testing.assert_close(last.lm_head.weight, whole.model.embed_tokens.weight, atol=0, rtol=0)


def test_activation_checkpointing_gives_the_same_gradients(checkpoints, helpers) -> None:
    directory = checkpoints["moe"]
    plain = _load(directory).train()
    recomputed = _load(directory, activation_checkpointing=True).train()
    for model in (plain, recomputed):
        losses = model(_inputs())
        assert isinstance(losses, torch.Tensor)
        losses.sum().backward()
    expected = helpers.d9d_gradients(plain)
    helpers.assert_same_gradients(helpers.d9d_gradients(recomputed), expected)


def test_meta_build_and_reset_parameters(checkpoints) -> None:
    config = read_qwen3_config(checkpoints["moe"])
    with torch.device("meta"):
        model = build_decoder(config, "causal_lm")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    model.reset_buffers()
    losses = model(_inputs())
    assert isinstance(losses, torch.Tensor) and torch.isfinite(losses).all()


@pytest.mark.parametrize("overlap", [True, False])
def test_materialized_stages_run_under_a_pipeline_executor_as_the_whole_model(checkpoints, overlap) -> None:
    # Without d9d-loop's meta copy the executor finds the stages' output shapes on the stages
    # themselves (pipeline_output_meta on materialized weights); DualPipeV's overlapped pairs take
    # turns at the stages' layer boundaries.
    from d9d.pipeline import DualPipeVScheduleConfig, LocalPipelineExecutor, build_program

    directory = checkpoints["moe"]
    program = build_program(DualPipeVScheduleConfig(overlap=overlap), num_ranks=2, num_microbatches=4)
    stages = {
        s: _load(directory, stage=PipelineStageInfo(current_stage=s, num_stages=4)).train() for s in range(4)
    }
    ids = torch.randint(0, 128, (4, 10), generator=torch.Generator().manual_seed(5))
    labels = causal_lm_targets(ids)
    targets = int((labels != -100).sum())
    losses = LocalPipelineExecutor(program, stages).step(
        DecoderInputs(input_ids=ids, labels=labels), loss_fn=lambda out, m: out.sum() / targets
    )
    whole = _load(directory).train()
    expected = []
    for m in range(4):  # the load-balancing loss is per microbatch, as in the pipeline
        loss = whole(DecoderInputs(input_ids=ids[m : m + 1], labels=labels[m : m + 1])).sum() / targets
        loss.backward()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), atol=1e-6, rtol=1e-5)
    reference = dict(whole.named_parameters())
    for stage in stages.values():
        for name, param in stage.named_parameters():
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, reference[name].grad, atol=1e-6, rtol=1e-4)
