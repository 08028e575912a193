"""The trainer: the GRPO objective (`fp4rl.train.grpo`). Logprob recomputation, the optimizer
and the train step live beside it."""

from fp4rl.train.grpo import GrpoConfig, group_advantages, grpo_loss

__all__ = ["GrpoConfig", "group_advantages", "grpo_loss"]
