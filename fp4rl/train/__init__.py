"""The trainer: the GRPO objective (`fp4rl.train.grpo`) and the optimizer step over FP32 master
weights (`fp4rl.train.optim`). Logprob recomputation and the train step live beside them."""

from fp4rl.train.grpo import GrpoConfig, group_advantages, grpo_loss
from fp4rl.train.optim import MasterAdamW, OptimConfig, lr_at

__all__ = ["GrpoConfig", "MasterAdamW", "OptimConfig", "group_advantages", "grpo_loss", "lr_at"]
