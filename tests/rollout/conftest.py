"""The rollout tests' tiny models: ``models`` maps ``(kv_cache, experts)`` to the packed rollout
model and its QAT trainer twin, built once per test module that asks for it."""

import pytest
from tiny_models import rollout_model


@pytest.fixture(scope="module")
def models():
    """(kv_cache, experts) -> (packed rollout model, QAT trainer twin)."""
    return {
        key: rollout_model(*key)
        for key in (("bf16", "bf16"), ("bf16", "nvfp4"), ("nvfp4", "nvfp4"))
    }
