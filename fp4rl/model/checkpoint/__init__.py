"""Hugging Face safetensors checkpoints <-> fp4rl state dicts.

``names`` holds the one mapping between hub tensor names and fp4rl parameter names, used in both
directions; ``reader`` loads a local checkpoint through it, ``writer`` saves one. This module
only re-exports their public names. The package does not own the model or the refit stream.
"""

from fp4rl.model.checkpoint.names import (
    INDEX_FILE,
    MODEL_FILE,
    Slot,
    fp4rl_to_hf,
    hf_to_fp4rl_names,
    non_finite,
    parameter_shapes,
)
from fp4rl.model.checkpoint.reader import load_state_dict
from fp4rl.model.checkpoint.writer import save_checkpoint

__all__ = [
    "INDEX_FILE",
    "MODEL_FILE",
    "Slot",
    "fp4rl_to_hf",
    "hf_to_fp4rl_names",
    "load_state_dict",
    "non_finite",
    "parameter_shapes",
    "save_checkpoint",
]
