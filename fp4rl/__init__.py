"""fp4rl: GRPO post-training of MoE language models with NVFP4 rollouts aligned to the trainer."""

__version__ = "0.1.0"
