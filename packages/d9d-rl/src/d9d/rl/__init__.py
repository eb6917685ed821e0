"""d9d-rl: colocated reinforcement learning on d9d: losses, rollout engines, weight streaming."""

from d9d.rl._losses import (
    Averaging,
    GRPOLossConfig,
    PolicyLossResult,
    group_advantages,
    grpo_loss,
    reinforce_loss,
)

__all__ = [
    "Averaging",
    "GRPOLossConfig",
    "PolicyLossResult",
    "group_advantages",
    "grpo_loss",
    "reinforce_loss",
]
