"""The embedded engine: KV-cached decoding equals the uncached model, log-probs equal training's."""

from __future__ import annotations

import pytest
import torch
from rl_tiny_model import VOCAB, tiny_model

from d9d.hf import DecoderInputs
from d9d.rl import EmbeddedRolloutEngine, SamplingParams

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 6], [11, 12]]  # ragged: per-row positions and masks matter


def _trainer_log_probs(prompt: list[int], completion: tuple[int, ...]) -> torch.Tensor:
    """What the trainer's forward (fused cross-entropy per token) gives for the completion tokens."""
    model = tiny_model()
    ids = torch.tensor([prompt + list(completion)])
    targets = torch.full_like(ids, -100)
    targets[0, len(prompt) - 1 : -1] = torch.tensor(completion)
    with torch.no_grad():
        losses = model(DecoderInputs(input_ids=ids, labels=targets))
    assert isinstance(losses, torch.Tensor)
    return -losses[0, len(prompt) - 1 : -1]


def test_log_probs_equal_the_trainers_forward() -> None:
    engine = EmbeddedRolloutEngine(tiny_model(), seed=1)
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=9, samples_per_prompt=2))
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2, 3, 3]
    for completion in completions:
        assert len(completion.token_ids) == 9 and completion.finish_reason == "length"
        expected = _trainer_log_probs(PROMPTS[completion.prompt_index], completion.token_ids)
        torch.testing.assert_close(completion.log_probs, expected, atol=2e-5, rtol=1e-5)


def test_greedy_decoding_equals_the_uncached_model() -> None:
    model = tiny_model()
    engine = EmbeddedRolloutEngine(tiny_model())
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(8):  # the whole sequence again each step: no cache
                ids.append(int(model.logits(torch.tensor([ids]))[0, -1].argmax()))
        assert completion.token_ids == tuple(ids[len(prompt) :])


def test_sampling_is_seeded_and_reproducible() -> None:
    engine = EmbeddedRolloutEngine(tiny_model())
    seeded = SamplingParams(max_tokens=6, samples_per_prompt=3, seed=5)
    first = [c.token_ids for c in engine.generate(PROMPTS, seeded)]
    assert first == [c.token_ids for c in engine.generate(PROMPTS, seeded)]
    assert first != [c.token_ids for c in engine.generate(PROMPTS, seeded.model_copy(update={"seed": 6}))]
    # unseeded calls follow the engine's seed
    a = EmbeddedRolloutEngine(tiny_model(), seed=3).generate(PROMPTS, SamplingParams(max_tokens=6))
    b = EmbeddedRolloutEngine(tiny_model(), seed=3).generate(PROMPTS, SamplingParams(max_tokens=6))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=6, top_k=1, seed=0),  # top-k 1 is greedy
        SamplingParams(max_tokens=6, top_p=1e-6, seed=0),  # a vanishing nucleus keeps only the top token
        SamplingParams(max_tokens=6, temperature=1e-4, seed=0),  # a cold temperature is greedy
    ],
)
def test_filters_that_leave_one_token_are_greedy(sampling: SamplingParams) -> None:
    engine = EmbeddedRolloutEngine(tiny_model())
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    assert [c.token_ids for c in engine.generate(PROMPTS, sampling)] == [c.token_ids for c in greedy]


def test_top_k_samples_only_among_the_top_tokens() -> None:
    model = tiny_model()
    engine = EmbeddedRolloutEngine(tiny_model())
    completions = engine.generate([[3]] * 64, SamplingParams(max_tokens=1, top_k=3, seed=0))
    with torch.no_grad():
        top = set(model.logits(torch.tensor([[3]]))[0, -1].topk(3).indices.tolist())
    seen = {c.token_ids[0] for c in completions}
    assert seen <= top and len(seen) > 1


def test_stop_tokens_end_a_row_and_are_kept() -> None:
    engine = EmbeddedRolloutEngine(tiny_model())
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
    stop_token = greedy[0].token_ids[2]
    stopped = engine.generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop_token,))
    )
    first = greedy[0].token_ids.index(stop_token)
    assert stopped[0].token_ids == greedy[0].token_ids[: first + 1]
    assert stopped[0].finish_reason == "stop"
    assert len(stopped[0].log_probs) == first + 1
    for before, after in zip(greedy[1:], stopped[1:], strict=True):
        # other rows are unaffected by a finished neighbour (it is masked out)
        n = len(after.token_ids)
        assert after.token_ids == before.token_ids[:n]


def test_update_weights_sleep_and_wake() -> None:
    engine = EmbeddedRolloutEngine(tiny_model(seed=0))
    other = tiny_model(seed=1)
    engine.update_weights(other.state_dict().items())
    for name, value in other.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value)
    before = engine.generate(PROMPTS, SamplingParams(max_tokens=4, seed=0))
    engine.sleep()
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, SamplingParams())
    engine.wake()
    after = engine.generate(PROMPTS, SamplingParams(max_tokens=4, seed=0))
    assert [c.token_ids for c in before] == [c.token_ids for c in after]
    with pytest.raises(KeyError, match="no weight 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        engine.update_weights([("lm_head.weight", torch.zeros(VOCAB, 3))])
