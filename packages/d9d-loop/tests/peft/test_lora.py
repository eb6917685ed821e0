"""LoRA: step 0 is the base model, training matches a hand-written LoRA, FSDP matches one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from loop_toy_job import Input, ToyDataset, build_trainer, full_parameters, toy_config
from torch import nn

from d9d.loop import EventBus, ForwardBackwardFinished
from d9d.loop.peft import LoRAConfig, LoRALinear, LoRATargetError, inject_lora, merged_state
from d9d.mesh.testing import run_distributed

LORA = {"kind": "lora", "target": "fc1|fc2", "r": 1, "alpha": 2.0}


def _config(mesh: dict[str, int] | None = None, **trainer: Any) -> Any:
    return toy_config(
        mesh=mesh or {},
        trainer={"peft": LORA, "gradient_clipping": {"max_norm": None}, **trainer},
        optimizer={"name": "sgd", "lr": 0.1},
        lr_scheduler={"name": "constant"},
        data={"shuffle": False},
    )


def test_step_zero_is_the_base_model_and_only_adapters_train() -> None:
    trainer = build_trainer(_config(max_steps=1), strategy="fsdp")
    model = trainer.model_stages[0]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "fc1.lora_A",
        "fc1.lora_B",
        "fc2.lora_A",
        "fc2.lora_B",
    }
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    params = full_parameters(trainer)
    base.load_state_dict(
        {k.replace("fc1", "0").replace("fc2", "2"): v for k, v in params.items() if "lora" not in k}
    )
    x = ToyDataset().x[:5]
    torch.testing.assert_close(model(Input(x=x), None), base(x))
    trainer.close()


def _hand_written_lora(params: dict[str, torch.Tensor], steps: int) -> list[float]:
    """Plain PyTorch: y = W x + b + scale * B A x on both layers, SGD, batches in order."""
    p = {k: v.clone().requires_grad_("lora" in k) for k, v in params.items()}
    scale = 2.0 / 1
    data = ToyDataset()
    losses = []
    for step in range(steps):
        x, y = data.x[step * 32 : (step + 1) * 32], data.y[step * 32 : (step + 1) * 32]

        def layer(h: torch.Tensor, name: str) -> torch.Tensor:
            return (
                F.linear(h, p[f"{name}.weight"], p[f"{name}.bias"])
                + scale * h @ p[f"{name}.lora_A"].T @ p[f"{name}.lora_B"].T
            )

        loss = F.mse_loss(layer(torch.tanh(layer(x, "fc1")), "fc2"), y)
        losses.append(float(loss.detach()))
        grads = torch.autograd.grad(loss, [v for v in p.values() if v.requires_grad])
        with torch.no_grad():
            for v, g in zip([v for v in p.values() if v.requires_grad], grads, strict=True):
                v.sub_(0.1 * g)
    return losses


def _lora_losses(mesh: dict[str, int]) -> dict[str, Any]:
    events = EventBus()
    losses: list[float] = []
    events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
    trainer = build_trainer(_config(mesh, max_steps=3), events=events, strategy="fsdp")
    initial = full_parameters(trainer)
    trainer.train()
    final = full_parameters(trainer)
    trainer.close()
    return {"losses": losses, "initial": initial, "final": final}


def test_lora_training_matches_a_hand_written_lora_and_fsdp_matches_one_process() -> None:
    single = run_distributed(_lora_losses, {}, world_size=1)[0]
    # B starts at zero, so the first steps move the adapters only: the base stays bit-identical
    for name, value in single["initial"].items():
        if "lora" not in name:
            torch.testing.assert_close(single["final"][name], value, rtol=0, atol=0)
    reference = _hand_written_lora(single["initial"], 3)
    torch.testing.assert_close(torch.tensor(single["losses"]), torch.tensor(reference), rtol=1e-5, atol=1e-7)
    for result in run_distributed(_lora_losses, {"data_parallel_shard": 2}, world_size=2):
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference), rtol=1e-5, atol=1e-7
        )


def test_merged_state_is_base_plus_scaled_b_times_a() -> None:
    model = nn.Sequential(nn.Linear(6, 4))
    inject_lora(model, LoRAConfig(target="0", r=2, alpha=3.0))
    layer = model[0]
    assert isinstance(layer, LoRALinear)
    with torch.no_grad():
        layer.lora_B.normal_()
    merged = merged_state(model)
    assert set(merged) == {"0.weight", "0.bias"}
    torch.testing.assert_close(merged["0.weight"], layer.weight + 1.5 * layer.lora_B @ layer.lora_A)
    plain = nn.Linear(6, 4)
    plain.load_state_dict({"weight": merged["0.weight"], "bias": merged["0.bias"]})
    x = torch.randn(3, 6)
    torch.testing.assert_close(plain(x), layer(x))


@pytest.mark.parametrize(
    ("peft", "message"),
    [
        # a pattern that matches no linear layer names the pattern and the layers there are
        (
            {**LORA, "target": "q_proj"},
            r"peft.target='q_proj' matches no linear layer of ToyModel \(.*fc1, fc2",
        ),
        # a rank larger than fc2's output width (1)
        ({**LORA, "r": 4}, r"layer 'fc2': LoRA rank r=4 exceeds .*out_features=1"),
    ],
)
def test_bad_lora_configs_fail_at_configure_time(peft: dict[str, Any], message: str) -> None:
    config = toy_config(trainer={"peft": peft})
    with pytest.raises(ValueError, match=message) as raised:
        build_trainer(config)
    if peft["target"] == "q_proj":
        assert isinstance(raised.value, LoRATargetError)
