"""``attention_mask``: attention skips padding, left or right, as transformers' does.

Real tokens of a padded row must get the outputs transformers gives them with the same mask:
class logits from the last real token, next-token logits on every real token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import d9d.hf
from d9d.hf import DecoderInputs, DecoderModel, MultiHeadBatch, MultiHeadSample, causal_lm_targets
from d9d.kernels.layers import (
    AttentionBackend,
    EagerAttentionBackend,
    GroupedQueryAttention,
    SdpaAttentionBackend,
    cu_seqlens_from_document_ids,
)

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
}
LENGTHS = [10, 6, 3]  # real tokens per row of a 10-token batch: full, padded, mostly padding


def _llama(kind: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    if kind == "causal_lm":
        return LlamaForCausalLM(LlamaConfig(**TINY))
    return LlamaForSequenceClassification(LlamaConfig(**TINY, num_labels=3))


def _qwen3(kind: str) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

    if kind == "causal_lm":
        return Qwen3ForCausalLM(Qwen3Config(**TINY))
    return Qwen3ForSequenceClassification(Qwen3Config(**TINY, num_labels=3))


BUILDERS: dict[str, Callable[[str], nn.Module]] = {"llama": _llama, "qwen3": _qwen3}


def _checkpoint(family: str, kind: str, directory: Path) -> nn.Module:
    torch.manual_seed(0)
    model: Any = BUILDERS[family](kind)
    model.save_pretrained(directory)
    return model.eval()


def _padded_batch(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    seq = max(LENGTHS)
    ids = torch.randint(1, 128, (len(LENGTHS), seq), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        if side == "left":
            mask[row, seq - length :] = 1
        else:
            mask[row, :length] = 1
    return ids.masked_fill(mask == 0, TINY["pad_token_id"]), mask


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_classification_of_a_padded_batch_matches_transformers(
    tmp_path: Path, family: str, side: str
) -> None:
    hf = _checkpoint(family, "sequence_classification", tmp_path)
    model = d9d.hf.load_pretrained(tmp_path, head="sequence_classification").eval()
    assert isinstance(model, DecoderModel) and model.export_head == "sequence_classification"
    ids, mask = _padded_batch(side)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(model.classify(ids, attention_mask=mask), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_causal_lm_logits_on_real_tokens_match_transformers(tmp_path: Path, family: str, side: str) -> None:
    hf = _checkpoint(family, "causal_lm", tmp_path)
    model = d9d.hf.load_pretrained(tmp_path).eval()
    assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
    ids, mask = _padded_batch(side)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        logits = model.logits(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], atol=1e-5, rtol=1e-5)
    # and each row equals the same tokens without padding
    with torch.no_grad():
        for row in range(len(LENGTHS)):
            alone = model.logits(ids[row : row + 1][:, real[row]])
            torch.testing.assert_close(logits[row][real[row]], alone[0], atol=1e-5, rtol=1e-5)


def test_left_padded_training_loss_and_gradients_match_transformers(tmp_path: Path, helpers: Any) -> None:
    hf = _checkpoint("llama", "sequence_classification", tmp_path).train()
    model = d9d.hf.load_pretrained(tmp_path, head="sequence_classification").train()
    ids, mask = _padded_batch("left")
    classes = torch.tensor([0, 2, 1])
    F.cross_entropy(hf(input_ids=ids, attention_mask=mask).logits, classes).backward()
    logits = model(DecoderInputs(input_ids=ids, attention_mask=mask))
    assert isinstance(logits, torch.Tensor)
    F.cross_entropy(logits, classes).backward()
    helpers.assert_same_gradients(helpers.d9d_gradients(model), helpers.hf_gradients(hf))


class VarlenAttention:
    """FlashAttention's reading of document ids on CPU: each run of equal ids is one sequence.

    The same ``cu_seqlens_from_document_ids`` the FlashAttention backends pass to the varlen
    kernel, each sequence then attended alone (causal SDPA): what those kernels compute.
    """

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float,
        sliding_window: int | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert document_ids is not None and sliding_window is None
        batch, seq, heads, dim = query.shape
        groups = heads // key.shape[2]
        q, k, v = (t.reshape(batch * seq, -1, dim) for t in (query, key, value))
        cu_seqlens, _ = cu_seqlens_from_document_ids(document_ids)
        parts = []
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
            out = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k[start:end].repeat_interleave(groups, dim=1).transpose(0, 1),
                v[start:end].repeat_interleave(groups, dim=1).transpose(0, 1),
                is_causal=causal,
                scale=softmax_scale,
            )
            parts.append(out.transpose(0, 1))
        return torch.cat(parts).reshape(batch, seq, heads, dim)


@pytest.mark.parametrize(
    "backend",
    [
        EagerAttentionBackend(),  # an explicit boolean mask
        SdpaAttentionBackend(),  # SDPA with that mask
        VarlenAttention(),  # runs of equal ids, as FlashAttention 2 and 4 read them
    ],
    ids=lambda backend: type(backend).__name__,
)
def test_every_attention_backend_skips_left_padding(tmp_path: Path, backend: AttentionBackend) -> None:
    hf = _checkpoint("qwen3", "causal_lm", tmp_path)
    model = d9d.hf.load_pretrained(tmp_path).eval()
    assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
    for module in model.modules():
        if isinstance(module, GroupedQueryAttention):
            module.attention_backend = backend
    ids, mask = _padded_batch("left")
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        logits = model.logits(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], atol=1e-5, rtol=1e-5)


def test_padding_between_real_tokens_is_refused_naming_the_row(tmp_path: Path) -> None:
    _checkpoint("llama", "causal_lm", tmp_path)
    model = d9d.hf.load_pretrained(tmp_path).eval()
    ids, mask = _padded_batch("left")
    mask[1, 7] = 0  # a hole: real tokens on both sides
    with pytest.raises(ValueError, match="attention_mask row 1 has padding between real tokens"):
        model.logits(ids, attention_mask=mask)


def test_a_mask_of_another_shape_is_refused(tmp_path: Path) -> None:
    _checkpoint("llama", "causal_lm", tmp_path)
    model = d9d.hf.load_pretrained(tmp_path).eval()
    ids, mask = _padded_batch("right")
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 9\), input_ids \(3, 10\)"):
        model.logits(ids, attention_mask=mask[:, 1:])


class _HostReads(TorchDispatchMode):
    """Records the ops that bring a tensor's values to the host (a synchronization on a GPU).

    ``.item()``, ``int()``, ``bool()`` reach ``_local_scalar_dense``; ``nonzero`` must know its
    output's size. On CPU nothing waits, but the same ops run: what would sync on a GPU shows here.
    """

    READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.item")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func.overloadpacket).startswith(self.READS) or str(func).startswith(self.READS):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_forward_with_an_attention_mask_reads_nothing_back_to_the_host(tmp_path: Path) -> None:
    # The training forward of a padded batch queues work only: the mask was checked on the host
    # (MultiHeadBatch.collate), so the forward does not wait for the device to check it again.
    # (A pooling head's check that no row is all padding still reads back, in d9d-kernels.)
    _checkpoint("llama", "causal_lm", tmp_path)
    model = d9d.hf.load_pretrained(tmp_path).train()
    ids, mask = _padded_batch("left")
    targets = causal_lm_targets(ids.masked_fill(mask == 0, -100))
    inputs = DecoderInputs(input_ids=ids, labels=targets, attention_mask=mask, summed_losses=True)
    model(inputs)  # warm-up: lazy initialization may read values once
    with _HostReads() as recorder:
        losses = model(inputs)
        assert isinstance(losses, torch.Tensor)
        losses.sum().backward()
    assert recorder.reads == []


def test_the_collator_refuses_padding_between_real_tokens_naming_the_row() -> None:
    ids, mask = _padded_batch("right")
    mask[2, 1] = 0  # row 2: real, pad, real
    samples = [MultiHeadSample(input_ids=i, attention_mask=m) for i, m in zip(ids, mask, strict=True)]
    with pytest.raises(ValueError, match="attention_mask row 2 has padding between real tokens"):
        MultiHeadBatch.collate(samples)
    batch = MultiHeadBatch.collate(samples[:2])  # rows padded at their ends are taken
    assert batch.attention_mask is not None and batch.attention_mask.shape == (2, max(LENGTHS))


def test_a_row_with_nothing_to_pool_is_refused_when_the_batch_is_built() -> None:
    # The pooled heads no longer read an accelerator's mask back: the host collator names the row.
    ids = torch.ones(3, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    samples = [
        MultiHeadSample(input_ids=i, attention_mask=m, class_labels={"sentiment": torch.tensor(1)})
        for i, m in zip(ids, mask, strict=True)
    ]
    with pytest.raises(ValueError, match="attention_mask row 1 is without any real token"):
        MultiHeadBatch.collate(samples)
    # without a pooled head's labels an all-padding row is only ignored by the LM loss
    MultiHeadBatch.collate(
        [MultiHeadSample(input_ids=i, attention_mask=m) for i, m in zip(ids, mask, strict=True)]
    )
