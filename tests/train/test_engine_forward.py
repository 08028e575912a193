"""The trainer's engine-order forward (``policy_logprobs(forward="engine")``,
`EngineOrderAttention`) against the rollout engine that generated the completions.

Claims (tiny model, NVFP4 experts and KV in layers 1-2, CPU, nearest rounding, completions of
different lengths: decode steps shrink as samples stop, contexts reach 50 tokens):
- BF16: every FP4 site record of the trainer (signed codes, block scales, global scales)
  equals the rollout's bitwise, prompt and completion rows alike, while the packed forward on
  the same completions misses thousands of codes; logprobs agree to LOGPROB_ATOL_BF16 (the
  lm_head over the engine's few last rows and the sampler's log_softmax order their FP32 sums
  differently, a few 1e-7 to 1e-5 nats). Prompt rows are the engine's own call on its own
  shapes; completion rows are bitwise only while the engine's padding of a decode step and its
  per-expert row counts leave the FP32 sums in the same order or change them below a BF16
  rounding (docs/alignment.md), which these completions exercise. The packed forward with FP32
  attention (``forward="packed_fp32"``: the engine's precision in SDPA's order) misses under a
  tenth of the packed forward's codes.
- FP32: those FP32 reorderings are not hidden by a rounding to BF16: codes stay bitwise, block
  scales too, global scales within GLOBAL_SCALE_RTOL (a few ulps of a row's amax).
- Gradients flow: in FP32 the engine-order forward's gradient of every parameter equals the
  packed forward's to GRAD_RTOL of its largest entry (the same function, summed in another
  order).
- The backend assembles causal attention within each sequence (FP32, random inputs; contexts
  that one decode row alone has included), and a follower attended through its leader's prefill
  gets the output it would get alone, bitwise.
- Refused: an unknown forward, a model off the CPU, prompt lengths or prefill leaders that do
  not fit.
- Wired through the loop: ``align.trainer_forward = "engine"`` makes every observed code agree
  and both gaps, observed and the update's, ~1 (the packed forward: 97.6 % of the codes).
"""

import pytest
import torch
from tiny_models import engine_config, rollout_model, tiny_precision

from fp4rl.config import AlignSection
from fp4rl.fp4.reference import unpack_e2m1
from fp4rl.model.attention import Bf16KV, CausalAttention, EngineOrderAttention, NewKV
from fp4rl.model.sites import SiteRecords
from fp4rl.model.transformer import build_model
from fp4rl.records import collate
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.train.observe import signed_index
from fp4rl.train.policy import policy_logprobs, prompt_lens

LOGPROB_ATOL_BF16 = 1e-4  # observed 2.5e-5 (the packed forward: 0.16)
LOGPROB_ATOL_FP32 = 1e-5  # observed 1.4e-6
GLOBAL_SCALE_RTOL = 2.0**-18  # ~16 FP32 ulps of a row's amax; observed 1.6e-6
GRAD_RTOL = 1e-4  # observed 2.4e-6
PROMPTS = [[5, 9, 14, 2, 77, 3, 3], [101, 4], [8, 8, 8, 61, 12, 90, 33, 1, 0, 7, 19]]


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=str)
def run(request):
    """``(dtype, qat model, batch)``: 9 completions of up to 40 tokens, a 30th of the
    vocabulary stopping samples early, full guidance recorded."""
    packed, qat = rollout_model("nvfp4", "nvfp4", seed=3, dtype=request.param)
    params = SamplingParams(n=3, max_tokens=40, seed=6, stop_token_ids=tuple(range(0, 128, 30)))
    config = engine_config(capture_routing=True, guidance="full")
    out = Engine(packed, config).generate(PROMPTS, params)
    batch = collate(out)
    assert len(set(batch.seq_lens)) > 3 and max(batch.seq_lens) > 32  # ragged, long contexts
    return request.param, qat, batch


def site_mismatches(model, batch, forward: str):
    """The trainer's records and logprobs: ``({site: (codes, block scales, global scales)
    differing}, global-scale relative error, logprobs)``."""
    rec = SiteRecords()
    with torch.no_grad():
        logp_N = policy_logprobs(model, batch, guided=False, capture=rec, forward=forward)
    differ, rel = {}, 0.0
    for key, theirs in batch.guidance.items():
        mine = rec.sites[key]
        codes = signed_index(unpack_e2m1(mine.codes)) != signed_index(unpack_e2m1(theirs.codes))
        scales = mine.block_scale.view(torch.uint8) != theirs.block_scale.view(torch.uint8)
        globals_ = mine.global_scale != theirs.global_scale
        differ[key] = (int(codes.sum()), int(scales.sum()), int(globals_.sum()))
        err = (mine.global_scale - theirs.global_scale).abs() / theirs.global_scale.clamp_min(1e-30)
        rel = max(rel, float(err.max()))
    return differ, rel, logp_N


def test_engine_forward_reproduces_the_rollout_at_every_site(run):
    dtype, qat, batch = run
    differ, rel, logp_N = site_mismatches(qat, batch, "engine")
    assert differ.keys() == qat.plan.guided_keys()
    gap = float((logp_N - batch.rollout_logprobs_N).abs().max())
    if dtype == torch.bfloat16:
        assert all(d == (0, 0, 0) for d in differ.values()), differ
        assert gap <= LOGPROB_ATOL_BF16
        packed, _, packed_logp_N = site_mismatches(qat, batch, "packed")
        missed = sum(d[0] for d in packed.values())
        assert missed > 1000  # the comparison can fail
        assert float((packed_logp_N - batch.rollout_logprobs_N).abs().max()) > 100 * gap
        # Attention in FP32 (the engine's precision, SDPA's order) removes most of that.
        fp32, _, _ = site_mismatches(qat, batch, "packed_fp32")
        assert sum(d[0] for d in fp32.values()) < missed / 10
    else:
        assert all(d[:2] == (0, 0) for d in differ.values()), differ
        assert rel <= GLOBAL_SCALE_RTOL
        assert gap <= LOGPROB_ATOL_FP32


def test_prompt_lengths_come_from_the_first_scored_row(run):
    _, _, batch = run
    lens = [len(PROMPTS[i]) for i in batch.prompt_index]
    assert prompt_lens(batch) == lens


def test_gradients_flow_and_match_the_packed_forward():
    packed, qat = rollout_model("nvfp4", "nvfp4", seed=3)
    params = SamplingParams(n=2, max_tokens=12, seed=5, stop_token_ids=(0, 10, 20))
    out = Engine(packed, engine_config(capture_routing=True)).generate(PROMPTS, params)
    batch = collate(out)
    grads = {}
    for forward in ("packed", "engine"):
        qat.zero_grad()
        policy_logprobs(qat, batch, guided=False, forward=forward).sum().backward()
        grads[forward] = {n: p.grad.clone() for n, p in qat.named_parameters()}
    for name, g in grads["engine"].items():
        assert torch.isfinite(g).all(), name
        want = grads["packed"][name]
        assert float((g - want).abs().max()) <= GRAD_RTOL * float(want.abs().max()), name
    assert all(g.abs().sum() > 0 for n, g in grads["engine"].items() if "q_proj" in n)


def test_refused_where_it_cannot_apply(run):
    _, qat, batch = run
    with pytest.raises(ValueError, match="forward must be one of"):
        policy_logprobs(qat, batch, guided=False, forward="fused")
    with pytest.raises(ValueError, match="align.trainer_forward must be one of"):
        AlignSection(trainer_forward="batch-invariant")
    meta = build_model(qat.config, tiny_precision("nvfp4", "nvfp4"), device="meta")
    with pytest.raises(ValueError, match="forward='engine' reproduces the engine's CPU"):
        policy_logprobs(meta, batch, replay=False, guided=False, forward="engine")
    with pytest.raises(ValueError, match="at most its sequence's length"):
        EngineOrderAttention([3, 4], [4, 1])
    with pytest.raises(ValueError, match="one length per sequence"):
        EngineOrderAttention([3, 4], [1])
    with pytest.raises(ValueError, match="prompt_lens must be positive lengths"):
        EngineOrderAttention([3, 4], [0, 1])


def test_backend_attends_like_causal_attention_and_shares_prefills():
    """FP32: the rows it assembles are causal attention within each sequence (to FP32 sums in
    another order); a follower's prompt rows, equal to its leader's, give the same output
    when they take the leader's attention."""
    g = torch.Generator().manual_seed(0)
    # Sequence 2 has no decode row; contexts 4, 5 and 10-12 have one decode row each.
    seq_lens, prompts = [9, 9, 4, 12], [5, 5, 4, 3]
    T = sum(seq_lens)
    q, k, v = (torch.randn(T, h, 16, generator=g) for h in (4, 2, 2))
    for x in (q, k, v):
        x[9:14] = x[0:5]  # sequence 1's prompt rows are sequence 0's
    kv = NewKV(k, v, Bf16KV())
    want = CausalAttention(seq_lens).attend(0, q, kv)
    alone = EngineOrderAttention(seq_lens, prompts).attend(0, q, kv)
    shared = EngineOrderAttention(seq_lens, prompts, prefilled_by=[0, 0, 2, 3]).attend(0, q, kv)
    torch.testing.assert_close(alone, want, rtol=0, atol=1e-6)
    assert torch.equal(shared, alone)
    with pytest.raises(ValueError, match="prefilled_by"):
        EngineOrderAttention(seq_lens, prompts, prefilled_by=[0, 0, 0, 3])  # other length
    with pytest.raises(ValueError, match="prefilled_by"):
        EngineOrderAttention(seq_lens, prompts, prefilled_by=[1, 1, 2, 3])  # a later one


def test_the_loop_observes_and_trains_with_the_engine_order(tmp_path):
    """`align.trainer_forward = "engine"` reaches both of the loop's forwards: the observed
    codes all agree with the rollout's (BF16, nearest rounding) and so do the logprobs the
    update trains on (the update's own token_mult_prob_error)."""
    from fp4rl import config as run_config
    from fp4rl import demo
    from fp4rl.loop import train
    from fp4rl.train.optim import OptimConfig

    overrides = ["model.dtype=bfloat16", "model.device=cpu"]
    warmup = demo.Warmup(steps=20, check_every=20, optim=OptimConfig(lr=3e-3, warmup_steps=5))
    base_config = run_config.load(demo.CONFIG_FILE, overrides)
    base = demo.base_policy(base_config, tmp_path / "cache", seed=0, warmup=warmup, log=print)
    config = run_config.load(
        demo.CONFIG_FILE,
        [
            *overrides,
            f"model.path={base}",
            f"run.out_dir={tmp_path / 'run'}",
            "run.steps=2",
            "run.eval_every=2",
            "align.observe_every=1",
            "align.rounding=nearest",
            "align.trainer_forward=engine",
            "engine.chunked_prefill=false",
            "rollout.prompts_per_step=16",
            "task.num_held_out=16",
            "task.format_reward=0.5",
        ],
    )
    steps = [m for m in train(config, log=lambda _: None) if "code_agreement" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["code_agreement"] == 1.0
        assert m["observed_token_mult_prob_error"] < 1 + LOGPROB_ATOL_BF16
        assert m["token_mult_prob_error"] < 1 + LOGPROB_ATOL_BF16  # the update's forward
