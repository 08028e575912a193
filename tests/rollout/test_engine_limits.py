"""What the engine stops on and refuses, on a tiny real model (FP32, CPU), and the KV pages it
gives back and takes again: stop tokens, EOS and length limits; prompts and engine settings
that do not fit the model; non-finite logits (and which rows count as bad); generating without
the KV pages. The outputs themselves, and their parity under any scheduling, are in
`test_engine.py`; the prompts and `assert_same_outputs` come from `engine_checks.py`, the
`models` fixture from `conftest.py`.
"""

import pytest
import torch
from engine_checks import PROMPTS, ForwardedModel, assert_same_outputs
from tiny_models import DEVICES, engine_config

from fp4rl.rollout import Engine, SamplingParams

config = engine_config


def test_stop_tokens_eos_and_lengths(models):
    packed, _ = models[("bf16", "bf16")]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    (free,) = Engine(packed, config()).generate(PROMPTS[:1], greedy)
    assert free.finish_reason == "length" and len(free.completion_ids) == 6
    third = free.completion_ids[2]
    first_at = free.completion_ids.index(third)
    stop = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(third,))
    (c,) = Engine(packed, config()).generate(PROMPTS[:1], stop)
    assert c.finish_reason == "stop" and c.completion_ids == free.completion_ids[: first_at + 1]
    eos_engine = Engine(packed, config(), eos_token_ids=(third,))
    (c,) = eos_engine.generate(PROMPTS[:1], greedy)
    assert c.finish_reason == "stop" and c.completion_ids[-1] == third
    ignoring = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (c,) = eos_engine.generate(PROMPTS[:1], ignoring)
    assert c.completion_ids == free.completion_ids
    # max_model_len bounds prompt + completion.
    (c,) = Engine(packed, config(max_model_len=14)).generate(PROMPTS[:1], greedy)
    assert c.finish_reason == "length" and len(c.prompt_ids) + len(c.completion_ids) == 14


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([[1, 2], []], "prompt 1 is empty"),
        ([[5] * 64], "prompt 0 has 64 tokens; engine.max_model_len=64"),
        ([[1], [2, 128]], r"prompt 1 has token id 128 outside the vocabulary \[0, 128\)"),
        ([[-1]], "prompt 0 has token id -1"),
    ],
)
def test_bad_prompts_raise(models, prompts, message):
    packed, _ = models[("bf16", "bf16")]
    with pytest.raises(ValueError, match=message):
        Engine(packed, config()).generate(prompts, SamplingParams())


def test_engine_settings_must_fit_the_model(models):
    packed, _ = models[("nvfp4", "nvfp4")]
    bf16, _ = models[("bf16", "bf16")]
    with pytest.raises(ValueError, match="engine.guidance='full' records FP4 sites, but"):
        Engine(bf16, config(guidance="full"))
    with pytest.raises(
        ValueError, match="max_model_len=512 exceeds .* max_position_embeddings=256"
    ):
        Engine(packed, config(max_model_len=512, max_num_batched_tokens=512))


# The engine reads a step's tokens and its bad-row flags in one copy, after the sampler ran on
# the bad rows too: every way of drawing must get there without an error of its own.
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -float("inf")], ids=str)
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=5),
        SamplingParams(max_tokens=5, top_k=3, top_p=0.9),
        SamplingParams(max_tokens=5, temperature=0.0),
    ],
    ids=["temperature", "top_k", "greedy"],
)
def test_non_finite_logits_stop_generation(models, fill, sampling):
    packed, _ = models[("bf16", "bf16")]

    class Poisoned(ForwardedModel):
        """The model, with non-finite logits once a sequence is longer than 3 tokens."""

        def hidden_states(self, tokens_T, attn, **kwargs):
            self.long = bool((attn.positions >= 3).any())
            return super().hidden_states(tokens_T, attn, **kwargs)

        def logits(self, h_NH, dtype=torch.float32):
            out = super().logits(h_NH, dtype)
            return out.fill_(fill) if self.long else out

    engine = Engine(Poisoned(packed), config())
    with pytest.raises(RuntimeError, match="non-finite logits for prompt 0 sample 0"):
        engine.generate([[1, 2]], sampling)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_rows_are_those_with_a_nan_a_positive_inf_or_nothing_finite(device):
    """The engine refuses a row holding a NaN or +inf logit anywhere, or only -inf ones; a row
    whose finite logits sit beside -inf ones (masked tokens) samples. On the GPU as on the CPU
    (the one reduction rests on the row maximum propagating NaN on both)."""
    from fp4rl.rollout.read_back import bad_rows

    nan, inf = float("nan"), float("inf")
    rows = {
        (0.5, -1.0, 2.0, 0.0): False,
        (0.5, -inf, 2.0, -inf): False,
        (-inf, -inf, -inf, 3.0): False,
        (0.5, nan, 2.0, 0.0): True,
        (nan, nan, nan, nan): True,
        (-inf, nan, -inf, -inf): True,
        (0.5, -1.0, inf, 0.0): True,
        (inf, nan, -inf, 1.0): True,
        (-inf, -inf, -inf, -inf): True,
        (inf, inf, inf, inf): True,
    }
    logits = torch.tensor(list(rows), dtype=torch.float32, device=device)
    assert bad_rows(logits).tolist() == list(rows.values())
    # Wide rows: the one bad logit anywhere in them.
    wide = torch.randn(3, 151936, device=device)
    wide[0, 151935], wide[1, 17], wide[2, :] = nan, inf, -inf
    assert bad_rows(wide).tolist() == [True, True, True]
    assert bad_rows(torch.randn(2, 151936, device=device)).tolist() == [False, False]


def test_kv_pages_can_be_given_back_and_taken_again(models):
    """A colocated trainer takes the pages' memory while it runs; the engine refuses to
    generate without them, and generates the same after taking them again."""
    packed, _ = models[("nvfp4", "nvfp4")]
    engine = Engine(packed, config())
    sampling = SamplingParams(n=2, max_tokens=6, seed=4)
    finished = []
    before = engine.generate(PROMPTS[:2], sampling, on_finish=finished.append)
    assert sum(finished) == 4
    engine.release_kv()
    engine.release_kv()  # released already: nothing more happens
    assert engine.cache is None
    with pytest.raises(RuntimeError, match="KV pages were released; call acquire_kv"):
        engine.generate(PROMPTS[:2], sampling)
    engine.acquire_kv()
    engine.acquire_kv()  # acquired already
    assert_same_outputs(before, engine.generate(PROMPTS[:2], sampling))
