"""d9d's Qwen3 models against transformers' on the same checkpoint: logits, loss, every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import d9d.hf
from d9d.hf import DecoderInputs, DecoderModel, causal_lm_targets


def _batch(seq: int = 12, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 128, (batch, seq), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt without loss
    return ids, labels


@pytest.mark.parametrize(
    "name",
    [
        "dense",  # YaRN, sliding-window layers, attention biases
        "tied",  # tied embeddings: one parameter, gradients of both uses
        "moe",  # experts, a dense layer among sparse ones; output_router_logits false: no aux loss
        "moe_aux",  # output_router_logits true: the load-balancing loss pooled over the 3 sparse layers
    ],
)
def test_causal_lm_matches_transformers(checkpoints, helpers, name) -> None:
    hf = helpers.hf_model(checkpoints[name]).train()
    model = d9d.hf.load_pretrained(checkpoints[name]).train()
    assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
    ids, labels = _batch()

    # transformers' own objective: cross-entropy, plus coef * aux when config.json asks for it
    out = hf(input_ids=ids, labels=labels)
    hf_loss = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    if name == "moe_aux":
        assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0
        torch.testing.assert_close(out.loss, hf_loss + 0.05 * out.aux_loss)
    else:
        torch.testing.assert_close(out.loss, hf_loss)
    out.loss.backward()

    loss = model.loss(ids, causal_lm_targets(labels))
    loss.backward()
    torch.testing.assert_close(loss, hf_loss, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), out.logits, atol=1e-5, rtol=1e-5)
    helpers.assert_same_gradients(helpers.d9d_gradients(model), helpers.hf_gradients(hf))


def test_load_balancing_loss_leaves_padding_out_as_transformers(checkpoints, helpers) -> None:
    # output_router_logits true and a left-padded batch: transformers' load_balancing_loss_func
    # counts only the tokens its attention_mask marks real (pooled over the 3 sparse layers)
    hf = helpers.hf_model(checkpoints["moe_aux"]).train()
    model = d9d.hf.load_pretrained(checkpoints["moe_aux"]).train()
    assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
    ids, _ = _batch(seq=12, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0  # mostly padding: counting pads would move the loss a lot
    # targets only on real positions: a pad's output (it attends to itself) is not transformers'
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)

    out = hf(input_ids=ids, attention_mask=mask, labels=labels)
    unmasked = hf(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    counted_pads = load_balancing_loss_func(unmasked, 8, 2)  # what counting the pads gives
    assert isinstance(counted_pads, torch.Tensor) and out.aux_loss is not None
    assert not torch.allclose(out.aux_loss, counted_pads, atol=1e-4, rtol=1e-4)
    out.loss.backward()

    loss = model.loss(ids, causal_lm_targets(labels), attention_mask=mask)
    loss.backward()
    hf_loss = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, hf_loss + 0.05 * out.aux_loss)
    torch.testing.assert_close(loss, hf_loss, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        real = mask.bool()
        torch.testing.assert_close(
            model.logits(ids, attention_mask=mask)[real], out.logits[real], atol=1e-5, rtol=1e-5
        )
    helpers.assert_same_gradients(helpers.d9d_gradients(model), helpers.hf_gradients(hf))


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_packed_documents_match_each_document_alone(checkpoints, helpers, name) -> None:
    # eval mode: no load-balancing loss, which would see the packed batch rather than each document
    hf = helpers.hf_model(checkpoints[name]).eval()
    model = d9d.hf.load_pretrained(checkpoints[name]).eval()
    ids, _ = _batch(seq=14)
    lengths = [[5, 9], [3, 6, 5]]  # documents per row; the second row has three
    document_ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths]
    )
    targets = causal_lm_targets(ids, document_ids=document_ids)

    losses = model(DecoderInputs(input_ids=ids, labels=targets, document_ids=document_ids))
    assert isinstance(losses, torch.Tensor)
    losses.sum().backward()
    with torch.no_grad():
        logits = model.logits(ids, document_ids=document_ids)

    hf_total = torch.zeros(())
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            doc = ids[row : row + 1, start : start + length]
            doc_logits = hf(input_ids=doc).logits
            torch.testing.assert_close(
                logits[row : row + 1, start : start + length], doc_logits, atol=1e-5, rtol=1e-5
            )
            doc_losses = F.cross_entropy(doc_logits[0, :-1], doc[0, 1:], reduction="none")
            torch.testing.assert_close(
                losses[row, start : start + length - 1], doc_losses, atol=1e-5, rtol=1e-5
            )
            assert losses[row, start + length - 1] == 0  # a document's last token predicts nothing
            hf_total = hf_total + doc_losses.sum()
            start += length
    hf_total.backward()
    helpers.assert_same_gradients(helpers.d9d_gradients(model), helpers.hf_gradients(hf))


def test_sequence_classification_matches_transformers(checkpoints, helpers) -> None:
    hf = helpers.hf_model(checkpoints["classifier"], "sequence_classification").train()
    model = d9d.hf.load_pretrained(checkpoints["classifier"], head="sequence_classification").train()
    assert isinstance(model, DecoderModel) and model.export_head == "sequence_classification"
    ids, _ = _batch(seq=10, batch=3)
    ids[0, 6:] = 0  # right padding: the class comes from token 5
    ids[2, 9:] = 0
    classes = torch.tensor([0, 2, 1])

    hf_logits = hf(input_ids=ids).logits
    F.cross_entropy(hf_logits, classes).backward()
    logits = model.classify(ids)
    F.cross_entropy(logits, classes).backward()

    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=1e-5)
    helpers.assert_same_gradients(helpers.d9d_gradients(model), helpers.hf_gradients(hf))


def test_embedding_head_is_normalized_last_token_state(checkpoints, helpers) -> None:
    hf = helpers.hf_model(checkpoints["dense"]).eval()
    model = d9d.hf.load_pretrained(checkpoints["dense"], head="embedding")
    ids, _ = _batch()
    with torch.no_grad():
        hidden = hf.model(input_ids=ids).last_hidden_state[:, -1]
        torch.testing.assert_close(model.embed(ids), F.normalize(hidden, dim=-1), atol=1e-5, rtol=1e-5)


def test_load_balancing_loss_key_overrides_config_json(checkpoints) -> None:
    from d9d.hf import HFModelProvider, PretrainedModelConfig
    from d9d.mesh import DistributedContext, MeshParameters

    context = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        for key, coefficient in [
            (None, 0.0),  # config.json's output_router_logits: false
            (True, 0.05),  # the objective gets router_aux_loss_coef * the pooled loss
            (False, 0.0),
        ]:
            provider = HFModelProvider(
                PretrainedModelConfig(source=str(checkpoints["moe"]), load_balancing_loss=key)
            )
            spec = provider.model_config(context).decoder_spec()
            assert spec.load_balancing_coefficient == coefficient
        dense = HFModelProvider(
            PretrainedModelConfig(source=str(checkpoints["dense"]), load_balancing_loss=True)
        )
        with pytest.raises(ValueError, match=r"model\.load_balancing_loss applies to models with MoE layers"):
            dense.model_config(context)
    finally:
        context.close()
