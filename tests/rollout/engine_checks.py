"""What the engine tests (`test_engine.py`, `test_engine_limits.py`) share: their prompts, the
FP32 logprob tolerance, `assert_same_outputs`, which holds two runs of the same requests to
the same completions and records up to the reordered-sum flips bounded below, and
`ForwardedModel`, a model the tests can alter one method of."""

import torch
from assertions import assert_records_close

LOGPROB_ATOL = 1e-5  # FP32 model; observed ~1.5e-6
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7] * 20, [3], [90, 12, 55, 4, 4, 4, 100]]

# Work that is only reordered (another batch, a recomputed prefill after preemption) sums in
# another order; where a value sits at an FP4 rounding midpoint that can flip one code (the
# effect guided rounding exists for) and move nearby logprobs by up to ~1e-2. Seen once in 300
# positions on one machine (0.004), never on another: bound the size and the share of such moves.
FLIP_ATOL, FLIP_SHARE = 2e-2, 0.05


def assert_same_outputs(a, b, *, capture=False):
    assert [(c.prompt_index, c.sample_index) for c in a] == [
        (c.prompt_index, c.sample_index) for c in b
    ]
    diffs = []
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and x.finish_reason == y.finish_reason
        diffs.append((x.logprobs - y.logprobs).abs())
        if capture:
            assert torch.equal(x.routing, y.routing)
            assert x.guidance.keys() == y.guidance.keys()
            for key in x.guidance:
                assert_records_close(x.guidance[key], y.guidance[key])
    diff = torch.cat(diffs)
    assert diff.max() <= FLIP_ATOL
    assert (diff > LOGPROB_ATOL).float().mean() <= FLIP_SHARE


class ForwardedModel:
    """``model`` as the engine uses it (config, plan, MoE layers, embeddings, hidden states,
    logits), forwarded as it is: a test overrides one method to change what the engine gets."""

    def __init__(self, model):
        self.model = model
        self.config, self.plan, self.moe_layers = model.config, model.plan, model.moe_layers
        self.embed_tokens = model.embed_tokens

    def hidden_states(self, tokens_T, attn, **kwargs):
        return self.model.hidden_states(tokens_T, attn, **kwargs)

    def logits(self, h_NH, dtype=torch.float32):
        return self.model.logits(h_NH, dtype)
