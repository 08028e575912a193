"""Sampler: greedy, temperature, top-k / top-p masks, per-sequence seeds, logprob meaning; and
its results bitwise equal to the full-sort sampler it replaced (`reference_sample`, kept here
verbatim), which ``benchmarks/sampler.py`` also times and compares against on the GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4rl.rollout import sampler
from fp4rl.rollout.config import SamplingParams
from fp4rl.rollout.sampler import Draws, make_generator, sample, sequence_seed


def _reference_sorted(logits_BV, temperature_B, top_k_B, top_p_B):
    scaled = logits_BV / temperature_B[:, None]
    sorted_BV, order_BV = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank_V = torch.arange(logits_BV.shape[1], device=logits_BV.device)
    keep_BV = rank_V[None, :] < top_k_B[:, None]
    probs_BV = torch.softmax(sorted_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
    mass_before_BV = probs_BV.cumsum(-1) - probs_BV
    keep_BV &= (mass_before_BV < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)  # top_p = 1: all
    return sorted_BV, order_BV, keep_BV


def reference_sample(logits_BV, params, generators):
    """The sampler as it was before the sort-free paths (every row sorted), verbatim but for
    top_p = 1 keeping every token: the definition the tests and ``benchmarks/sampler.py`` hold
    `sample` to."""
    B, V = logits_BV.shape
    device = logits_BV.device
    logits_BV = logits_BV.float()
    u_B = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    u_B = u_B.to(device)
    greedy_B = torch.tensor([p.greedy for p in params], device=device)
    temperature_B = torch.tensor(
        [1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32, device=device
    )
    top_k_B = torch.tensor([p.top_k or V for p in params], device=device)
    top_p_B = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)

    raw_logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    sorted_BV, order_BV, keep_BV = _reference_sorted(logits_BV, temperature_B, top_k_B, top_p_B)
    logprobs_sorted_BV = torch.log_softmax(sorted_BV.masked_fill(~keep_BV, float("-inf")), -1)
    cdf_BV = logprobs_sorted_BV.double().exp().cumsum(-1)
    rank_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    rank_B = torch.minimum(rank_B, (logprobs_sorted_BV > float("-inf")).sum(-1) - 1)
    rank_B = torch.where(greedy_B, torch.zeros_like(rank_B), rank_B)

    token_B = order_BV.gather(1, rank_B[:, None])[:, 0]
    raw_B = raw_logprobs_BV.gather(1, token_B[:, None])[:, 0]
    processed_B = logprobs_sorted_BV.gather(1, rank_B[:, None])[:, 0]
    return sampler.SampleOutput(
        token_ids_B=token_B,
        logprobs_B=torch.where(greedy_B, raw_B, processed_B),
        raw_logprobs_B=raw_B,
    )


def _gens(n, seed=0):
    return [make_generator(seed, 0, j) for j in range(n)]


def test_greedy_is_argmax_with_ties_to_the_lowest_id_and_reports_raw_logprob():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = logits[0, 30] = logits[0].max() + 1.0  # a tie
    out = sample(logits, [SamplingParams(temperature=0)] * 5, _gens(5))
    assert out.token_ids_B.tolist() == logits.argmax(-1).tolist()
    assert out.token_ids_B[0] == 7
    raw = torch.log_softmax(logits, -1).gather(1, out.token_ids_B[:, None])[:, 0]
    assert torch.equal(out.logprobs_B, raw) and torch.equal(out.raw_logprobs_B, raw)


def test_logprob_is_of_the_processed_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=g) * 3
    params = SamplingParams(temperature=0.7, top_k=5)
    out = sample(logits, [params] * 64, _gens(64))
    scaled = logits / 0.7
    top5 = scaled.topk(5, dim=-1)
    for b in range(64):
        tok = int(out.token_ids_B[b])
        assert tok in top5.indices[b].tolist()
        expected = scaled[b, tok] - torch.logsumexp(top5.values[b], 0)
        torch.testing.assert_close(out.logprobs_B[b], expected, rtol=0, atol=1e-5)
        raw = torch.log_softmax(logits[b], 0)[tok]
        torch.testing.assert_close(out.raw_logprobs_B[b], raw, rtol=0, atol=0)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4000, 4).contiguous()
    out = sample(logits, [SamplingParams(top_p=0.75)] * 4000, _gens(4000))
    # 0.5 + 0.3 reaches 0.75: tokens 1 and 3 stay, renormalized to 0.625 / 0.375.
    assert set(out.token_ids_B.tolist()) == {1, 3}
    frac = (out.token_ids_B == 1).float().mean().item()
    assert abs(frac - 0.625) < 4 * (0.625 * 0.375 / 4000) ** 0.5  # 4 sigma
    expected = torch.where(
        out.token_ids_B == 1, torch.tensor(0.625).log(), torch.tensor(0.375).log()
    )
    torch.testing.assert_close(out.logprobs_B, expected, rtol=0, atol=1e-6)


def test_unmasked_sampling_matches_the_softmax_frequencies():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, float("-inf")]]).expand(20000, 5).contiguous()
    out = sample(logits, [SamplingParams()] * 20000, _gens(20000, seed=3))
    counts = torch.bincount(out.token_ids_B, minlength=5).float()
    p = torch.softmax(logits[0], 0)
    assert counts[4] == 0  # probability zero is never drawn
    sigma = (20000 * p * (1 - p)).sqrt()
    assert ((counts - 20000 * p).abs() <= 4 * sigma + 1e-6).all(), (counts, 20000 * p)


def test_a_row_depends_only_on_its_logits_and_generator():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 30, generator=g)
    params = [
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0),
        SamplingParams(top_k=3),
        SamplingParams(temperature=1.3),
        SamplingParams(top_k=10, top_p=0.5),
        SamplingParams(),
    ]
    batch = sample(logits, params, [make_generator(11, 0, j) for j in range(6)])
    for b in reversed(range(6)):  # alone, and in another order
        alone = sample(logits[b : b + 1], params[b : b + 1], [make_generator(11, 0, b)])
        assert alone.token_ids_B.item() == batch.token_ids_B[b].item()
        assert alone.logprobs_B.item() == batch.logprobs_B[b].item()


def test_each_token_consumes_exactly_one_draw_even_when_greedy():
    for params in (SamplingParams(), SamplingParams(temperature=0)):
        gen = make_generator(5, 1, 2)
        reference = make_generator(5, 1, 2)
        for _ in range(3):
            sample(torch.randn(1, 10), [params], [gen])
            torch.rand((), generator=reference, dtype=torch.float64)
        assert torch.equal(gen.get_state(), reference.get_state())


@pytest.mark.parametrize("block", [1, 7, 64])
def test_draws_give_the_generators_numbers_in_order(block):
    """`Draws` takes a generator's numbers a block at a time: the n-th number taken is the
    n-th single draw, across block boundaries and for any block (the engine's tokens rest on
    torch's CPU generator drawing a block's values one after another)."""
    for seed in (0, 1, 2**62 + 5):
        draws = Draws(make_generator(seed, 3, 1), block=block)
        single = make_generator(seed, 3, 1)
        want = [torch.rand((), generator=single, dtype=torch.float64).item() for _ in range(150)]
        assert [draws.next() for _ in range(150)] == want


def test_sampling_from_draws_equals_sampling_from_generators():
    """Rows sampled from `Draws` over several steps: the tokens and logprobs of rows sampled
    from their generators directly, whatever the block."""
    g = torch.Generator().manual_seed(4)
    params = [SamplingParams(), SamplingParams(top_k=5), SamplingParams(temperature=0)] * 2
    generators = [make_generator(9, 0, j) for j in range(6)]
    draws = [Draws(make_generator(9, 0, j), block=3) for j in range(6)]
    for _ in range(8):
        logits = torch.randn(6, 50, generator=g) * 3
        _assert_same(sample(logits, params, draws), sample(logits, params, generators))


def test_temperature_one_rows_skip_the_division_with_the_same_bits():
    """With every sampled row at temperature 1 the logits are not divided (x / 1 is x): the
    results of the definition, which divides, for rows holding -0.0, +0.0 and -inf logits."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 300, generator=g) * 4
    logits[:, :3] = torch.tensor([-0.0, 0.0, float("-inf")])
    mixed = [SamplingParams(top_k=9), SamplingParams()] * 2 + [SamplingParams(temperature=0)]
    for params in ([SamplingParams()] * 5, mixed):
        want = reference_sample(logits, params, _gens(5, 2))
        _assert_same(sample(logits, params, _gens(5, 2)), want)


def test_draws_refuse_an_empty_block():
    with pytest.raises(ValueError, match="Draws.block must be at least 1; got 0"):
        Draws(make_generator(0, 0, 0), block=0)


def test_sequence_seeds_differ_across_samples_and_prompts():
    seeds = {sequence_seed(0, i, j) for i in range(20) for j in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 logit rows, 1 params"):
        sample(torch.zeros(2, 4), [SamplingParams()], _gens(2))


# --- The sort-free paths equal the full sort bitwise ---------------------------------------


@pytest.fixture(params=["selection", "sort"])
def top_k_path(request, monkeypatch):
    """Each test that uses it runs twice: top-k rows by partial selection whatever the batch
    and device, then sorted (`sampler._selects_top_k` picks by batch size and device)."""
    selects = request.param == "selection"
    monkeypatch.setattr(sampler, "_selects_top_k", lambda rows, device, narrow: selects)
    return request.param


def test_top_k_rows_sort_on_a_gpu_but_fp32_rows_of_large_batches(monkeypatch):
    bound = sampler.TOP_K_SELECTION_MIN_ROWS
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    sizes = (1, bound - 1, bound, 4 * bound)
    assert [sampler._selects_top_k(b, gpu, False) for b in sizes] == [False, False, True, True]
    assert not any(sampler._selects_top_k(b, gpu, True) for b in sizes)
    assert all(sampler._selects_top_k(b, cpu, narrow) for b in sizes for narrow in (False, True))
    # What `sample` calls it with: 16-bit values when every top-k row is at temperature 1.
    seen = []
    monkeypatch.setattr(
        sampler, "_selects_top_k", lambda rows, device, narrow: seen.append(narrow) or True
    )
    logits = _logits("peaked", 4, 256, 0)
    top_k_at_1 = [SamplingParams(top_k=5), SamplingParams(temperature=0.7)] * 2
    top_k_scaled = [SamplingParams(top_k=5, temperature=0.7), SamplingParams()] * 2
    for given, params in ((logits.bfloat16(), top_k_at_1), (logits.bfloat16(), top_k_scaled),
                          (logits, top_k_at_1)):  # fmt: skip
        sample(given, params, _gens(4))
    assert seen == [True, False, False]


_SETTINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_p=0.95),
    SamplingParams(top_p=0.5, temperature=1.3),
    SamplingParams(top_k=50),
    SamplingParams(top_k=20, top_p=0.8),
    SamplingParams(top_k=3, temperature=2.0),
    SamplingParams(top_k=1),
    SamplingParams(top_k=300, top_p=0.99),
    SamplingParams(top_k=4095),  # V - 1
    SamplingParams(top_k=10**6),  # beyond V: no cut, the sorted path
    SamplingParams(temperature=0),
]


def _logits(kind: str, B: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g)
    if kind == "peaked":  # like a trained LM's
        x *= 4
    elif kind == "tiny":  # most tokens have probability far below 2^-53
        x *= 40
    elif kind == "ties":  # a few distinct values, so the k-th is tied with many left out
        x = (x * 1.5).round()
    elif kind == "-inf":
        x[torch.rand(B, V, generator=g) < 0.6] = float("-inf")
    return x


def _assert_same(out, ref):
    assert torch.equal(out.token_ids_B, ref.token_ids_B)
    assert torch.equal(out.logprobs_B, ref.logprobs_B)
    assert torch.equal(out.raw_logprobs_B, ref.raw_logprobs_B)


@pytest.mark.parametrize("kind", ["flat", "peaked", "tiny", "ties", "-inf"])
def test_results_equal_the_full_sort_bitwise_for_mixed_settings_in_one_batch(kind, top_k_path):
    B, V = 48, 4096
    for seed in range(6):
        logits = _logits(kind, B, V, seed)
        params = [_SETTINGS[(b + seed) % len(_SETTINGS)] for b in range(B)]
        out = sample(logits, params, _gens(B, seed))
        _assert_same(out, reference_sample(logits, params, _gens(B, seed)))


# Rows that sort without a top-p cut (top_p = 1, top-k none or past V) skip computing their
# all-true masks when every such row of the batch has them; top-k and greedy rows beside them.
_UNMASKED = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=10**6, temperature=1.3),
    SamplingParams(top_k=50),
    SamplingParams(temperature=0),
]


@pytest.mark.parametrize("kind", ["flat", "peaked", "tiny", "ties", "-inf"])
def test_results_equal_the_full_sort_bitwise_without_a_top_p_cut(kind, top_k_path):
    B, V = 40, 4096
    for seed in range(4):
        logits = _logits(kind, B, V, seed)
        for params in (
            [_UNMASKED[0]] * B,
            [_UNMASKED[(b + seed) % len(_UNMASKED)] for b in range(B)],
        ):
            out = sample(logits, params, _gens(B, seed))
            _assert_same(out, reference_sample(logits, params, _gens(B, seed)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["flat", "peaked", "ties", "-inf"])
def test_16_bit_logits_sample_as_their_fp32_copies_bitwise(kind, dtype, top_k_path):
    """The engine passes the lm_head's BF16 logits: temperature-1 rows sort those 16-bit values
    (many ties at this width), every other row the FP32 copies, and nothing differs from the
    definition on the FP32 copies."""
    B, V = 48, 4096
    for seed in range(4):
        logits = _logits(kind, B, V, seed).to(dtype)
        for params in (
            [SamplingParams()] * B,  # every sorted row at temperature 1: the 16-bit sort
            [_SETTINGS[(b + seed) % len(_SETTINGS)] for b in range(B)],
        ):
            out = sample(logits, params, _gens(B, seed))
            _assert_same(out, reference_sample(logits.float(), params, _gens(B, seed)))


def test_16_bit_logits_sort_as_given_only_at_temperature_1(monkeypatch):
    """Which rows sort the 16-bit values: temperature-1 ones, not rows whose scaled logits are
    FP32 values of their own (a temperature of 0.7 makes new ties and new orders)."""
    sorted_dtypes, real_sort = [], torch.sort

    def recording_sort(x, *args, **kwargs):
        sorted_dtypes.append(x.dtype)
        return real_sort(x, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", recording_sort)
    logits = _logits("peaked", 4, 512, 0).bfloat16()
    sample(logits, [SamplingParams()] * 4, _gens(4))
    sample(logits, [SamplingParams(), SamplingParams(temperature=0.7)] * 2, _gens(4))
    sample(logits.float(), [SamplingParams()] * 4, _gens(4))
    assert sorted_dtypes == [torch.bfloat16, torch.float32, torch.float32]


def test_results_equal_the_full_sort_at_qwen3s_vocabulary(top_k_path):
    B, V = 12, 151936
    logits = _logits("peaked", B, V, 7)
    out = sample(logits, _SETTINGS, _gens(B, 7))
    _assert_same(out, reference_sample(logits, _SETTINGS, _gens(B, 7)))


def test_a_top_k_of_tied_values_takes_the_lowest_ids_as_the_stable_sort(top_k_path):
    # Row 0: every logit equal, so any 3 of them are the 3 largest; the sort's are ids 0-2.
    # Row 1: the 2nd largest value is shared by ids 5 and 900-999; top-k 30 keeps 5, 900-927.
    logits = torch.zeros(2, 1000)
    logits[1, 5] = logits[1, 900:] = 1.0
    logits[1, 700] = 2.0
    params = [SamplingParams(top_k=3), SamplingParams(top_k=30)]
    for seed in range(40):
        out = sample(logits, params, _gens(2, seed))
        _assert_same(out, reference_sample(logits, params, _gens(2, seed)))
        assert out.token_ids_B[0] < 3
        assert out.token_ids_B[1].item() in {700, 5, *range(900, 928)}


def test_candidates_are_the_stable_sorts_prefix_values_and_ids():
    g = torch.Generator().manual_seed(3)
    for _ in range(100):
        V = int(torch.randint(2, 300, (), generator=g))
        K = int(torch.randint(1, V + 1, (), generator=g))
        x = torch.randint(-3, 3, (4, V), generator=g).float()  # many ties
        x[torch.rand(4, V, generator=g) < 0.2] = float("-inf")
        values, ids = sampler._candidates(x, K)
        sorted_values, order = x.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(values, sorted_values[:, :K]) and torch.equal(ids, order[:, :K])


def test_a_rows_result_does_not_depend_on_the_other_rows_top_k(top_k_path):
    """The top-k path selects as many candidates as the batch's largest top-k."""
    logits = _logits("peaked", 3, 2000, 5)
    params = [SamplingParams(top_k=7), SamplingParams(top_k=1500), SamplingParams()]
    batch = sample(logits, params, _gens(3, 9))
    alone = sample(logits[:1], params[:1], _gens(1, 9))
    assert batch.token_ids_B[0] == alone.token_ids_B[0]
    assert batch.logprobs_B[0] == alone.logprobs_B[0]


@pytest.mark.parametrize("source", ["generators", "draws"])
def test_sampling_reads_nothing_back_from_the_device(source):
    """A value read back from the logits' device (item, tolist, bool, int of a tensor) would
    synchronize a GPU step; which row takes which path must follow from the SamplingParams
    alone. Logits on the meta device hold no values, so any such read raises; the draws, taken
    on the host, may be read."""
    B = len(_SETTINGS)
    logits = _logits("peaked", B, 3000, 1).to("meta")
    gens = _gens(B) if source == "generators" else [Draws(g) for g in _gens(B)]
    out = sample(logits, _SETTINGS, gens)
    for t in (out.token_ids_B, out.logprobs_B, out.raw_logprobs_B):
        assert t.device.type == "meta" and t.shape == (B,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_never_waits_for_the_device():
    """The step's values cross to the GPU by queued copies from pinned memory: a blocking copy
    would wait for the forward queued before the sampler (sync-debug raises on one)."""
    logits = _logits("peaked", len(_SETTINGS), 3000, 1)
    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(on_gpu, _SETTINGS, _gens(len(_SETTINGS)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The definition on the same device (the same kernels, so the same bits).
    _assert_same(out, reference_sample(on_gpu, _SETTINGS, _gens(len(_SETTINGS))))


def test_the_benchmark_smoke_run_finds_equal_outputs():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "sampler.py"
    argv = ["--device", "cpu", "--vocab", "3000", "--batch", "1,5", "--repeats", "1"]
    run = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| rand")]
    assert len(rows) == 3 * 2 * 9  # logits kinds x batches x settings
    for row in rows:  # the token-order draw picks other tokens: its logprobs are checked
        verdict = "logprobs exact" if "token order" in row else "bitwise equal"
        assert row.endswith(f"| {verdict} |"), run.stdout


@pytest.mark.parametrize("params", [SamplingParams(top_k=5), SamplingParams()])
def test_a_token_of_small_probability_is_drawn_where_the_full_sort_draws_it(params, top_k_path):
    """Token 77 holds ~8e-5 of the mass, the last sliver of the CDF: of 40000 sample streams,
    the few whose draw lands at the top must pick it, as the reference does, and its neighbours
    by the draw must not."""
    logits = torch.full((1, 3000), -40.0)
    logits[0, [900, 10, 2000, 5]] = 0.0
    logits[0, 77] = -8.0
    logits[0, 1000:1100] = float("-inf")
    u = [
        torch.rand((), generator=make_generator(0, 0, j), dtype=torch.float64) for j in range(40000)
    ]
    streams = [j for j in range(40000) if u[j] > 1 - 3e-4]
    gens = lambda: [make_generator(0, 0, j) for j in streams]  # noqa: E731
    n = len(streams)
    out = sample(logits.expand(n, -1), [params] * n, gens())
    _assert_same(out, reference_sample(logits.expand(n, -1), [params] * n, gens()))
    drawn = out.token_ids_B.tolist()
    assert 77 in drawn and set(drawn) - {77}, drawn


def test_top_p_of_one_keeps_the_tail_that_fp32_running_mass_rounds_away():
    # Over a vocabulary this large the FP32 running mass of the sorted probabilities reaches
    # 1.0 long before the tail (rounding): masking by "mass before < 1" kept only the first
    # 64k-87k of these 151,936 tokens. With top_p = 1 a draw at the very top of the CDF must
    # reach the tail, with a finite logprob.
    g = torch.Generator().manual_seed(0)
    sorted_BV = (torch.randn(2, 151936, generator=g) * 4).sort(-1, descending=True).values
    V = torch.tensor([151936, 151936])
    rank_B, logprob_B = sampler._walk(
        sorted_BV, V, torch.ones(2), torch.tensor([1 - 1e-13, 0.5], dtype=torch.float64)
    )
    assert rank_B[0] > 150_000 and torch.isfinite(logprob_B).all()
