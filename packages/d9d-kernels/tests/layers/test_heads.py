"""Language-modelling, classification and embedding heads; pooling."""

import pytest
import torch
from torch.nn import functional

from d9d.kernels.layers import (
    ClassificationHead,
    EmbeddingHead,
    LanguageModelHead,
    Pooling,
    check_pooling_mask,
    pool_hidden_states,
)


def test_lm_head_returns_per_token_losses_and_gradients() -> None:
    torch.manual_seed(0)
    head = LanguageModelHead(16, 37)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 5))
    labels[0, 1] = -100
    losses = head(hidden, labels)
    assert losses.shape == (2, 5) and losses.dtype == torch.float32
    hidden_ref = hidden.detach().clone().requires_grad_()
    weight_ref = head.weight.detach().clone().requires_grad_()
    expected = functional.cross_entropy(
        functional.linear(hidden_ref, weight_ref).reshape(-1, 37), labels.reshape(-1), reduction="none"
    ).reshape(2, 5)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    assert float(losses[0, 1].detach()) == 0.0
    losses.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(hidden.grad, hidden_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, weight_ref.grad, rtol=1e-5, atol=1e-6)


def test_lm_head_logits_on_request() -> None:
    head = LanguageModelHead(8, 11)
    hidden = torch.randn(3, 8)
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ head.weight.T)


def test_lm_head_logit_scale_multiplies_the_logits_of_the_loss_and_of_inference() -> None:
    torch.manual_seed(0)
    head = LanguageModelHead(8, 11, logit_scale=0.25)
    hidden = torch.randn(2, 3, 8)
    labels = torch.randint(0, 11, (2, 3))
    logits = (hidden @ head.weight.T) * 0.25
    torch.testing.assert_close(head.compute_logits(hidden), logits)
    expected = functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(head(hidden, labels), expected.reshape(2, 3), rtol=1e-5, atol=1e-6)


def test_lm_head_rejects_mismatched_labels() -> None:
    head = LanguageModelHead(8, 11)
    with pytest.raises(ValueError, match="labels shape"):
        head(torch.randn(2, 4, 8), torch.zeros(2, 3, dtype=torch.int64))


HIDDEN = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
MASK = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])  # right padding, left padding

# (pooling, expected pooled rows under MASK)
POOLING_CASES: list[tuple[Pooling, torch.Tensor]] = [
    ("first", torch.stack([HIDDEN[0, 0], HIDDEN[1, 1]])),  # first real token
    ("last", torch.stack([HIDDEN[0, 2], HIDDEN[1, 3]])),  # last real token
    ("mean", torch.stack([HIDDEN[0, :3].mean(0), HIDDEN[1, 1:].mean(0)])),  # mean over real tokens
]


@pytest.mark.parametrize(("pooling", "expected"), POOLING_CASES)
def test_pooling_respects_padding(pooling: Pooling, expected: torch.Tensor) -> None:
    torch.testing.assert_close(pool_hidden_states(HIDDEN, pooling, attention_mask=MASK), expected)


@pytest.mark.parametrize("pooling", ["first", "last", "mean"])
def test_pooling_rejects_a_host_mask_with_an_empty_row_naming_it(pooling: Pooling) -> None:
    mask = MASK.clone()
    mask[1] = 0
    with pytest.raises(ValueError, match="row 1 is without any real token"):
        pool_hidden_states(HIDDEN, pooling, attention_mask=mask)
    with pytest.raises(ValueError, match="row 1 is without any real token"):
        check_pooling_mask(mask)


@pytest.mark.parametrize("pooling", ["first", "last", "mean"])
def test_an_unchecked_empty_row_pools_to_nan_and_the_others_are_unchanged(pooling: Pooling) -> None:
    # what an accelerator's mask gets by default: its values are not read back (no device sync)
    mask = MASK.clone()
    mask[1] = 0
    pooled = pool_hidden_states(HIDDEN, pooling, attention_mask=mask, check=False)
    expected = pool_hidden_states(HIDDEN, pooling, attention_mask=MASK)
    torch.testing.assert_close(pooled[0], expected[0])
    assert pooled[1].isnan().all()


@pytest.mark.parametrize("pooling", ["first", "last", "mean"])
def test_pooling_runs_on_the_meta_device(pooling: Pooling) -> None:
    # a pipeline's shape pass runs the last stage on meta tensors: no value may be read there
    hidden = torch.empty(2, 4, 8, device="meta")
    mask = torch.empty(2, 4, dtype=torch.int64, device="meta")
    assert pool_hidden_states(hidden, pooling, attention_mask=mask).shape == (2, 8)


def test_classification_head_pools_then_classifies() -> None:
    torch.manual_seed(0)
    head = ClassificationHead(3, 5, pooling="last")
    logits = head(HIDDEN, MASK)
    torch.testing.assert_close(logits, head.classifier(torch.stack([HIDDEN[0, 2], HIDDEN[1, 3]])))


@pytest.mark.parametrize("output_size", [None, 6])  # pooled vector as is, learned projection
def test_embedding_head_normalizes(output_size: int | None) -> None:
    torch.manual_seed(0)
    head = EmbeddingHead(3, pooling="mean", output_size=output_size)
    embedding = head(HIDDEN, MASK)
    assert embedding.shape == (2, output_size or 3)
    torch.testing.assert_close(embedding.norm(dim=-1), torch.ones(2))
    raw = EmbeddingHead(3, pooling="mean", normalize=False)(HIDDEN, MASK)
    if output_size is None:
        torch.testing.assert_close(embedding, functional.normalize(raw, dim=-1))
