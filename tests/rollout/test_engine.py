"""The engine's outputs and records on a tiny real model (FP32, CPU): right, and unchanged by how
it schedules the work. What it stops on or refuses, and the KV pages it gives back, are in
`test_engine_limits.py`; the prompts, tolerances and `assert_same_outputs` both use are in
`engine_checks.py`, the `models` fixture in `conftest.py`.

Parity claims and their tolerances. The rollout model holds its FP4 experts packed; the
trainer's full-sequence forward (`CausalAttention`, no cache) runs either that same model or its
QAT twin. Cached decode and full forward differ only in summation order (paged attention vs
SDPA, GEMMs over different row counts), so in FP32 the logprobs agree to LOGPROB_ATOL and the
greedy tokens are identical. Everything that only reorders work (prefix sharing, preemption,
batch composition, chunked prefill, overlapped steps) must leave tokens and routing identical
and logprobs within the same tolerance; FP4 records within `assert_records_close`. Where the
trainer is guided by the rollout's records, codes and scales are compared bitwise.

To extend to the QAT-parity check: take a `Completion` from any test here and compare
`trainer_logprobs(qat, c, replay=True, guided=True)` with `c.raw_logprobs`
(`test_trainer_with_replay_and_guidance_reproduces_the_rollout` does this in FP32).
"""

import pytest
import torch
from assertions import assert_matches_rollout
from engine_checks import LOGPROB_ATOL, PROMPTS, ForwardedModel, assert_same_outputs
from tiny_models import engine_config, rollout_model, trainer_distribution, trainer_logprobs

from fp4rl.fp4 import CompactCodes, NVFP4Tensor, compact
from fp4rl.fp4.reference import unpack_e2m1
from fp4rl.model.sites import SiteRecords
from fp4rl.records import capture_bytes_per_generated_token
from fp4rl.rollout import Engine, SamplingParams

config = engine_config


@pytest.mark.parametrize("kv, experts", [("bf16", "bf16"), ("bf16", "nvfp4"), ("nvfp4", "nvfp4")])
def test_cached_decode_matches_full_sequence_forward(models, kv, experts):
    packed, _ = models[(kv, experts)]
    engine = Engine(packed, config())
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    assert len(out) == len(PROMPTS)
    for c in out:
        full_NV = trainer_distribution(packed, c)
        assert list(c.completion_ids) == full_NV.argmax(-1).tolist()
        torch.testing.assert_close(
            c.raw_logprobs, trainer_logprobs(packed, c), rtol=0, atol=LOGPROB_ATOL
        )
        assert torch.equal(c.logprobs, c.raw_logprobs)  # greedy reports the raw logprob


def test_trainer_with_replay_and_guidance_reproduces_the_rollout(models):
    """The QAT twin, fed the rollout's routing and full guidance, recomputes every FP4 code the
    rollout recorded (bitwise) and its logprobs (to LOGPROB_ATOL)."""
    packed, qat = models[("nvfp4", "nvfp4")]
    engine = Engine(packed, config(capture_routing=True, guidance="full"))
    out = engine.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=16, seed=7))

    for c in out:
        rec = SiteRecords()
        logprobs = trainer_logprobs(qat, c, replay=True, guided=True, capture=rec)
        torch.testing.assert_close(logprobs, c.raw_logprobs, rtol=0, atol=LOGPROB_ATOL)
        assert rec.sites.keys() == c.guidance.keys()
        for key, t in c.guidance.items():
            assert_matches_rollout(rec.sites[key], t, str(key))
        for i, layer in enumerate(qat.moe_layers):
            assert torch.equal(rec.routing[layer], c.routing[i])


def test_trainer_follows_compact_guidance_in_the_layers_it_keeps(models):
    """Compact guidance keeps mantissa bits for the latter FP4 layers only; the trainer must
    accept it (the others round to nearest) and reproduce the kept mantissa bits."""
    packed, qat = models[("nvfp4", "nvfp4")]
    engine = Engine(packed, config(capture_routing=True, guidance="compact"))
    for c in engine.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=12, seed=9)):
        rec = SiteRecords()
        logprobs = trainer_logprobs(qat, c, replay=True, guided=True, capture=rec)
        torch.testing.assert_close(logprobs, c.raw_logprobs, rtol=0, atol=LOGPROB_ATOL)
        kept = {key: r for key, r in c.guidance.items() if r is not None}
        assert kept and all(layer == 2 for layer, _ in kept)
        for key, r in kept.items():
            assert torch.equal(compact(rec.sites[key]).mantissa_bits, r.mantissa_bits), key


def test_bf16_trainer_guided_by_the_rollout_recomputes_its_codes():
    """In BF16 the trainer's own nearest rounding disagrees with the rollout on a good share of
    FP4 codes (5-17 % observed); replaying routing and following full guidance, it takes the
    rollout's code everywhere and its logprobs agree to 0.03 (observed 0.016; the rest is
    BF16 attention and GEMM ordering, against up to 0.18 when the forward is unguided)."""
    packed, qat = rollout_model("nvfp4", "nvfp4", dtype=torch.bfloat16)
    engine = Engine(packed, config(capture_routing=True, guidance="full"))
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    unguided_mismatch = []
    for c in out:
        guided, plain = SiteRecords(), SiteRecords()
        logprobs = trainer_logprobs(qat, c, replay=True, guided=True, capture=guided)
        torch.testing.assert_close(logprobs, c.raw_logprobs, rtol=0, atol=0.03)
        trainer_logprobs(qat, c, capture=plain)
        for key, t in c.guidance.items():
            assert_matches_rollout(guided.sites[key], t, str(key))
            codes = unpack_e2m1(plain.sites[key].codes) & 7, unpack_e2m1(t.codes) & 7
            unguided_mismatch.append((codes[0] != codes[1]).float().mean())
    assert torch.stack(unguided_mismatch).mean() > 0.01  # the check above has teeth


def test_prefix_sharing_leaves_outputs_unchanged(models):
    packed, _ = models[("nvfp4", "nvfp4")]
    sampling = SamplingParams(n=4, max_tokens=12, seed=3)
    capture = dict(capture_routing=True, guidance="full")
    shared_stats, alone_stats = {}, {}
    shared = Engine(packed, config(**capture)).generate(PROMPTS[:2], sampling, stats=shared_stats)
    # One seat: every sample waits for the previous one and prefills the prompt itself.
    alone = Engine(packed, config(max_num_seqs=1, **capture)).generate(
        PROMPTS[:2], sampling, stats=alone_stats
    )
    assert shared_stats["prefill_tokens"] == len(PROMPTS[0]) + len(PROMPTS[1])
    assert alone_stats["prefill_tokens"] == 4 * (len(PROMPTS[0]) + len(PROMPTS[1]))
    assert_same_outputs(shared, alone, capture=True)
    assert len({c.completion_ids for c in shared}) == 8  # the samples do differ


def test_preemption_leaves_outputs_unchanged(models):
    packed, _ = models[("nvfp4", "nvfp4")]
    sampling = SamplingParams(n=3, max_tokens=40, seed=5)
    capture = dict(capture_routing=True, guidance="full")
    roomy = Engine(packed, config(**capture)).generate(PROMPTS, sampling)
    # 20 blocks of 4 tokens hold one 64-token sequence and little else: 12 sequences of up to
    # ~60 tokens must take turns.
    per_token = 2 * 2 * 2 * 16 * 4 + 2 * 2 * 2 * (8 + 1 + 4)  # 2 FP32 layers, 2 NVFP4 layers
    tight_engine = Engine(packed, config(kv_memory_bytes=20 * 4 * per_token, **capture))
    assert tight_engine.num_blocks == 20
    stats = {}
    tight = tight_engine.generate(PROMPTS, sampling, stats=stats)
    assert stats["preemptions"] >= 5
    assert_same_outputs(roomy, tight, capture=True)


def test_seed_reproduces_regardless_of_batch_composition(models):
    packed, _ = models[("bf16", "nvfp4")]
    engine = Engine(packed, config())
    sampling = SamplingParams(n=2, max_tokens=16, temperature=0.8, top_p=0.9, seed=11)
    alone = engine.generate(PROMPTS[:1], sampling)
    crowded = engine.generate(PROMPTS, sampling)
    assert_same_outputs(alone, crowded[:2])
    other_seed = engine.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=16, seed=12))
    assert [c.completion_ids for c in other_seed] != [c.completion_ids for c in alone]


def test_a_step_of_prefill_chunks_alone_samples_nothing(models):
    """In tight memory, preemptions can leave a step with nothing but a prompt's chunk to feed:
    no row's logits are taken and nothing is sampled, and the outputs stay those of a roomy
    engine fed whole prompts."""
    packed, _ = models[("nvfp4", "nvfp4")]
    per_token = 2 * 2 * 2 * 16 * 4 + 2 * 2 * 2 * (8 + 1 + 4)  # as in the preemption test
    capture = dict(capture_routing=True, guidance="full")
    tight = Engine(packed, config(max_num_batched_tokens=20, kv_memory_bytes=20 * 4 * per_token,
                                  **capture))  # fmt: skip
    sampling = SamplingParams(n=3, max_tokens=30, seed=5)
    stats = {}
    got = tight.generate(PROMPTS, sampling, stats=stats)
    assert stats["preemptions"] > 0
    assert_same_outputs(got, Engine(packed, config(**capture)).generate(PROMPTS, sampling),
                        capture=True)  # fmt: skip


@pytest.mark.parametrize("kv, experts", [("bf16", "nvfp4"), ("nvfp4", "nvfp4")])
def test_chunked_prefill_leaves_outputs_and_records_unchanged(models, kv, experts):
    """A step budget of 20 tokens cuts the 20- and 11-token prompts into chunks fed beside the
    other sequences' decodes; completions, logprobs and every record equal those of prompts
    prefilled whole (up to the reordered-sum flips bounded above)."""
    packed, _ = models[(kv, experts)]
    capture = dict(capture_routing=True, guidance="full")
    whole = Engine(packed, config(**capture))
    chunked = Engine(packed, config(max_num_batched_tokens=20, **capture))
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=5)
    stats = {}
    got = chunked.generate(PROMPTS, params, stats=stats)
    assert_same_outputs(got, whole.generate(PROMPTS, params), capture=True)
    assert stats["prefill_tokens"] == sum(len(p) for p in PROMPTS)
    assert stats["eager_steps"] == stats["steps"] > 0, "off the GPU every step runs eagerly"
    assert stats["graphs_captured"] == stats["capture_seconds"] == 0


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_overlapped_steps_leave_outputs_and_records_unchanged(models, tight):
    """Decode steps launched before the previous step's tokens are read (their tokens fed
    where they lie) give the completions, logprobs and records of steps taken one at a time,
    with samples that stop early (their extra row dropped), chunked prefills and, in tight
    memory, preemptions between the overlapped runs."""
    packed, _ = models[("nvfp4", "nvfp4")]
    capture = dict(capture_routing=True, guidance="full", max_num_batched_tokens=20)
    if tight:  # as in test_preemption_leaves_outputs_unchanged
        per_token = 2 * 2 * 2 * 16 * 4 + 2 * 2 * 2 * (8 + 1 + 4)
        capture["kv_memory_bytes"] = 20 * 4 * per_token
    # Stop ids among the tokens unstopped samples draw, so that some samples stop early.
    probe = Engine(packed, config(overlap_steps=False, **capture)).generate(
        PROMPTS, SamplingParams(n=3, max_tokens=30, seed=5)
    )
    stop_ids = (probe[0].completion_ids[12], probe[7].completion_ids[20])
    params = SamplingParams(n=3, max_tokens=30, seed=5, stop_token_ids=stop_ids)
    runs = {}
    for overlap in (False, True):
        stats = {}
        engine = Engine(packed, config(overlap_steps=overlap, **capture))
        runs[overlap] = engine.generate(PROMPTS, params, stats=stats), stats
    (one_at_a_time, plain_stats), (overlapped, stats) = runs[False], runs[True]
    assert plain_stats["overlapped_steps"] == 0 and stats["overlapped_steps"] >= 10
    assert sum(c.finish_reason == "stop" for c in overlapped) >= 3
    assert (stats["preemptions"] > 0) == tight
    assert_same_outputs(overlapped, one_at_a_time, capture=True)
    for c in overlapped:  # one record per token fed, none of a dropped row's, all recorded
        assert c.routing.shape[1] == len(c.prompt_ids) + len(c.completion_ids) - 1
        assert (c.routing >= 0).all()


def test_a_bf16_model_samples_alike_from_its_bf16_logits_and_their_fp32_copies():
    """The engine hands the sampler the lm_head's BF16 logits, which temperature-1 rows sort as
    they are: the completions (tokens, logprobs, raw logprobs) are bitwise those of the same
    engine handed FP32 copies of them, at temperature 1 and beside rows of other settings."""
    packed, _ = rollout_model("nvfp4", "nvfp4", dtype=torch.bfloat16)

    class FP32Logits(ForwardedModel):
        """The model, its logits cast to FP32 whatever the engine asks for."""

        def logits(self, h_NH, dtype=torch.float32):
            return super().logits(h_NH, torch.float32)

    grpo = SamplingParams(n=3, max_tokens=12, seed=5)  # every row sorts the BF16 logits
    mixed = [
        grpo,
        SamplingParams(n=2, max_tokens=12, seed=6, temperature=0.8, top_p=0.9),
        SamplingParams(n=1, max_tokens=12, seed=7, top_k=5),
        SamplingParams(n=2, max_tokens=12, seed=8),
    ]
    for sampling in (grpo, mixed):
        got = Engine(packed, config()).generate(PROMPTS, sampling)
        want = Engine(FP32Logits(packed), config()).generate(PROMPTS, sampling)
        for a, b in zip(got, want, strict=True):
            assert a.completion_ids == b.completion_ids
            assert torch.equal(a.logprobs, b.logprobs)
            assert torch.equal(a.raw_logprobs, b.raw_logprobs)


def test_sampling_params_per_prompt(models):
    """A list gives each prompt its own n, temperature, limits, seed and CDF order: each
    prompt's samples are those of a call giving every prompt that prompt's params."""
    packed, _ = models[("bf16", "nvfp4")]
    engine = Engine(packed, config())
    params = [
        SamplingParams(n=2, max_tokens=16, temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(n=3, max_tokens=9, temperature=1.2, seed=4, stop_token_ids=(7,)),
        SamplingParams(n=2, max_tokens=12, seed=4, cdf_order="token"),
    ]
    mixed = engine.generate(PROMPTS, params)
    assert [(c.prompt_index, c.sample_index) for c in mixed] == [
        (i, j) for i, p in enumerate(params) for j in range(p.n)
    ]
    start = 0
    for i, p in enumerate(params):
        alone = [c for c in engine.generate(PROMPTS, p) if c.prompt_index == i]
        assert_same_outputs(mixed[start : start + p.n], alone)
        start += p.n
    by_probability = engine.generate(PROMPTS[3:], SamplingParams(n=2, max_tokens=12, seed=4))
    assert [c.completion_ids for c in by_probability] != [c.completion_ids for c in mixed[-2:]]
    with pytest.raises(ValueError, match="sampling holds 2 SamplingParams for 3 prompts"):
        engine.generate(PROMPTS[:3], params[:2])
    with pytest.raises(TypeError, match=r"sampling\[1\] must be a SamplingParams, got dict"):
        engine.generate(PROMPTS[:2], [params[0], {"n": 2}])


@pytest.mark.parametrize("mode", ["full", "compact"])
def test_capture_shapes_and_bytes(models, mode):
    packed, _ = models[("nvfp4", "nvfp4")]
    engine = Engine(packed, config(capture_routing=True, guidance=mode))
    out = engine.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=10, seed=1))
    H, I, k, Hkv, D = 64, 32, 2, 2, 16
    # FP4 layers are 1 and 2; "compact" keeps the latter half: layer 2.
    layers = (1, 2) if mode == "full" else (2,)
    shapes = {"expert_input": (H,), "expert_hidden": (k, I), "k": (Hkv, D), "v": (Hkv, D)}
    for c in out:
        T = c.num_fed_tokens
        assert c.routing.dtype == torch.int32 and c.routing.shape == (3, T, k)
        assert c.routing.min() >= 0 and c.routing.max() < 8
        kept = {key: r for key, r in c.guidance.items() if r is not None}
        assert set(kept) == {(layer, site) for layer in layers for site in shapes}
        # Left-out layers are marked for nearest rounding rather than missing.
        assert {key for key, r in c.guidance.items() if r is None} == {
            (layer, site) for layer in {1, 2} - set(layers) for site in shapes
        }
        for (_, site), r in kept.items():
            assert isinstance(r, NVFP4Tensor if mode == "full" else CompactCodes)
            assert r.shape == (T, *shapes[site])
    # Bytes per fed token and layer: values at 4 bits (full) or 1 bit (compact), one E4M3
    # scale per 16 values, one FP32 global scale per row.
    bits = 4 if mode == "full" else 1
    rows = {"expert_input": (1, H), "expert_hidden": (k, I), "k": (Hkv, D), "v": (Hkv, D)}
    per_layer = sum(n * (w * bits // 8 + w // 16 + 4) for n, w in rows.values())
    assert per_layer == (136 if mode == "full" else 64)
    for c in out:
        assert c.guidance_nbytes() == per_layer * len(layers) * c.num_fed_tokens
        assert c.routing_nbytes() == 4 * 3 * c.num_fed_tokens * k
    report = capture_bytes_per_generated_token(out)
    generated = sum(len(c.completion_ids) for c in out)
    fed = sum(c.num_fed_tokens for c in out)
    assert report["guidance"] == per_layer * len(layers) * fed / generated
    print(
        f"guidance={mode}: {report['guidance']:.1f} B/generated token, routing "
        f"{report['routing']:.1f} B/generated token"
    )


def test_capture_is_off_by_default(models):
    packed, _ = models[("nvfp4", "nvfp4")]
    (c,) = Engine(packed, config()).generate(PROMPTS[:1], SamplingParams(max_tokens=3))
    assert c.routing is None and c.guidance is None


def test_completion_records(models):
    packed, _ = models[("bf16", "bf16")]
    engine = Engine(packed, config())
    engine.policy_version = 3
    out = engine.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=5, seed=0))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for c in out:
        assert c.policy_version == 3 and c.prompt_ids == tuple(PROMPTS[c.prompt_index])
        assert c.logprobs.dtype == torch.float32 and c.logprobs.shape == (5,)
    (c,) = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2, return_logprobs=False))
    assert c.logprobs is None and c.raw_logprobs is None
