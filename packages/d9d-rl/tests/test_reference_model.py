"""The GRPO reference model: its log-probs, its memory between uses, the k3 KL term and refusals.

Independent references: transformers' Qwen3 forward on the same checkpoints, and TRL's GRPO
objective written out here (per-token k3 ``exp(ref - lp) - (ref - lp) - 1`` weighted by ``beta``,
clipped ratio, ``bnpo`` token mean or ``grpo`` per-sequence mean).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rl_tiny_model import VOCAB, tiny_config
from transformers import AutoModelForCausalLM

from d9d.hf import (
    DecoderCausalLM,
    HFModelProvider,
    PretrainedModelConfig,
    save_pretrained,
)
from d9d.loop import (
    BuildForwardInputsContext,
    ComputeLossContext,
)
from d9d.mesh import DistributedContext, MeshParameters
from d9d.rl import (
    Completion,
    GRPOLossConfig,
    GRPOTask,
    ReferenceConfig,
    ReferenceModel,
    RolloutBatch,
)

BETA = 0.3


def _checkpoint(directory: Path, seed: int, **fields: Any) -> Path:
    """A freshly initialized tiny Qwen3 (no sliding window), saved as transformers saves it."""
    config = tiny_config(sliding_window=False).model_copy(update=fields)
    torch.manual_seed(seed)
    model = DecoderCausalLM(config, attention_backend="eager")
    model.reset_parameters()
    save_pretrained(model, directory)
    return directory


def _policy() -> DecoderCausalLM:
    """The policy: the tiny model of seed 0, as ``_checkpoint(..., seed=0)`` saves it."""
    torch.manual_seed(0)
    model = DecoderCausalLM(tiny_config(sliding_window=False), attention_backend="eager")
    model.reset_parameters()
    return model


def _provider(source: Path) -> HFModelProvider:
    return HFModelProvider(PretrainedModelConfig(source=str(source), attention_backend="eager"))


@pytest.fixture
def single_process() -> Iterator[DistributedContext]:
    """A one-rank context, closed after the test (a process group left open leaks into later tests)."""
    context = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        yield context
    finally:
        context.close()


def _batch() -> RolloutBatch:
    """Five completions of different lengths after two prompts, right-padded; ratios that clip."""
    generator = torch.Generator().manual_seed(4)
    prompts = [[3, 7, 11], [5, 2]]
    lengths = [4, 1, 3, 5, 2]
    completions = [
        Completion(
            prompt_index=row % 2,
            token_ids=[int(t) for t in torch.randint(1, VOCAB, (n,), generator=generator)],
            log_probs=-torch.rand(n, generator=generator) * 4,
            finish_reason="length",
        )
        for row, n in enumerate(lengths)
    ]
    return RolloutBatch.from_completions(prompts, completions, torch.tensor([1.2, -0.4, 0.0, 2.0, -1.5]))


def _transformers_log_probs(directory: Path, batch: RolloutBatch) -> torch.Tensor:
    """log p(target) from transformers' forward of the checkpoint (0 where there is no target)."""
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits.float()
    taken = torch.log_softmax(logits, dim=-1).gather(-1, batch.targets.clamp(min=0)[..., None])[..., 0]
    return taken.masked_fill(batch.targets == -100, 0.0)


def test_reference_log_probs_equal_transformers_on_the_reference_checkpoint(
    tmp_path: Path, single_process: DistributedContext
) -> None:
    policy_dir = _checkpoint(tmp_path / "policy", seed=0)
    reference_dir = _checkpoint(tmp_path / "reference", seed=1)  # another checkpoint, same shapes
    policy = _policy()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    # three rows per forward: the five rows run as 3 + 2, which must not change any value
    reference = ReferenceModel(_provider(reference_dir), ReferenceConfig(microbatch_size=3))
    reference.build(dist_context=single_process, policy=policy)
    batch = _batch()

    got = reference.log_probs(batch.decoder_inputs())

    torch.testing.assert_close(got, _transformers_log_probs(reference_dir, batch), atol=2e-5, rtol=1e-5)
    assert not torch.allclose(got, _transformers_log_probs(policy_dir, batch))  # not the policy's
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())  # policy untouched
    assert all(not p.requires_grad for p in reference.module.parameters())
    # between uses the weights live in host memory only: every device storage is freed (on CPU the
    # same path runs, with the host copy on the CPU too)
    assert reference.is_offloaded
    assert all(p.untyped_storage().nbytes() == 0 for p in reference.module.parameters())
    again = reference.log_probs(batch.decoder_inputs())  # brought back bit-exact for the next use
    assert torch.equal(again, got)


def test_offload_false_keeps_the_weights_on_the_device(
    tmp_path: Path, single_process: DistributedContext
) -> None:
    reference = ReferenceModel(
        _provider(_checkpoint(tmp_path / "ref", seed=1)), ReferenceConfig(offload=False)
    )
    reference.build(dist_context=single_process, policy=_policy())
    reference.log_probs(_batch().decoder_inputs())
    assert not reference.is_offloaded
    assert all(p.untyped_storage().nbytes() > 0 for p in reference.module.parameters())


def test_a_reference_checkpoint_of_other_shapes_is_refused_naming_the_tensor(
    tmp_path: Path, single_process: DistributedContext
) -> None:
    wider = _checkpoint(tmp_path / "wider", seed=1, intermediate_size=64)
    reference = ReferenceModel(_provider(wider))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(32, 64\)"):
        reference.build(dist_context=single_process, policy=_policy())


def test_kl_coefficient_without_a_reference_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"kl_coefficient=0\.1 needs a reference model"):
        GRPOTask(GRPOLossConfig(kl_coefficient=0.1))


def _trl_objective(
    lp: torch.Tensor, batch: RolloutBatch, ref: torch.Tensor, config: GRPOLossConfig
) -> torch.Tensor:
    """TRL's GRPOTrainer loss with ``beta = kl_coefficient`` (``bnpo`` = token, ``grpo`` = sequence)."""
    mask = (batch.targets != -100).float()
    coef_1 = torch.exp(lp - batch.old_log_probs)
    coef_2 = coef_1.clamp(1 - config.epsilon_low, 1 + config.epsilon_high)
    advantages = batch.advantages[:, None]
    per_token = -torch.minimum(coef_1 * advantages, coef_2 * advantages)
    per_token = per_token + config.kl_coefficient * (torch.exp(ref - lp) - (ref - lp) - 1)
    if config.averaging == "token":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def test_grpo_task_with_a_reference_equals_trls_objective_and_gradients(
    tmp_path: Path, single_process: DistributedContext
) -> None:
    policy_dir = _checkpoint(tmp_path / "policy", seed=0)
    reference_dir = _checkpoint(tmp_path / "reference", seed=1)
    reference = ReferenceModel(_provider(reference_dir))
    reference.build(dist_context=single_process, policy=_policy())
    batch = _batch()
    batch.ref_log_probs = reference.log_probs(batch.decoder_inputs())
    hf = AutoModelForCausalLM.from_pretrained(policy_dir, attn_implementation="eager", dtype=torch.float32)
    hf_reference = _transformers_log_probs(reference_dir, batch)
    for averaging in ("token", "sequence"):  # TRL's loss_type bnpo and grpo
        config = GRPOLossConfig(kl_coefficient=BETA, epsilon_low=0.2, epsilon_high=0.28, averaging=averaging)
        policy = _policy()
        task = GRPOTask(config, reference=reference)
        built = task.build_forward_inputs(BuildForwardInputsContext(batch=batch, step=0))
        context = ComputeLossContext(
            pipeline_results=policy(built.input, None), state=built.state, microbatch_index=0, step=0
        )
        result = task.compute_loss(context)
        result.loss.backward()

        hf.zero_grad()
        logits = hf(input_ids=batch.input_ids).logits
        lp = torch.log_softmax(logits, -1).gather(-1, batch.targets.clamp(min=0)[..., None])[..., 0]
        expected = _trl_objective(lp, batch, hf_reference, config)
        expected.backward()

        torch.testing.assert_close(result.loss, expected, atol=1e-5, rtol=1e-5)
        assert result.metrics["kl"] > 0
        hf_grads = dict(hf.named_parameters())
        for name, parameter in policy.named_parameters():
            hf_grad = hf_grads[name].grad
            assert parameter.grad is not None and hf_grad is not None, name
            torch.testing.assert_close(parameter.grad, hf_grad, atol=1e-6, rtol=1e-4, msg=name)
