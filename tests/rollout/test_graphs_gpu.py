"""Decode steps replayed from CUDA graphs (`fp4rl.rollout.graphs`) against eager steps.

At a batch that is a bucket size every decode step runs the same kernels on the same shapes
eagerly and graphed, so completions, logprobs and records must agree bit for bit; at other
batches the padding rows must write only the scratch block and compute what their source row
computes. Graphs must follow a refit (weights copied in place) and a release of the KV pages
(kept, or dropped with them). Tiny model with head dim 32, the paged kernel's smallest for BF16
queries over NVFP4 pages.
"""

import dataclasses

import pytest
import torch
from tiny_models import FP4_EVERYWHERE, engine_config, packed_twin, qat_model, tiny_config

from fp4rl.fp4 import CompactCodes
from fp4rl.kernels import dependent_launch
from fp4rl.loop import phase
from fp4rl.refit import RefitReceiver, refit_records
from fp4rl.rollout import Engine, SamplingParams, graphs
from fp4rl.rollout.graphs import MAX_GRAPH_BATCH, bucket_for
from fp4rl.rollout.prefill_graphs import prefill_bucket

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# The engines the bitwise comparisons run: experts, KV pages and the guidance they record.
RECORDED_ENGINES = pytest.mark.parametrize(
    "experts, kv_cache, guidance",
    [("nvfp4", "nvfp4", "full"), ("nvfp4", "bf16", "compact"), ("bf16", "bf16", None)],
)

# Eight prompts of different lengths, prefilled in one step, then decoded together: 8 rows.
PROMPTS = [[1 + i, 2, 3 + i, 4][: 1 + i % 4] + [5] * i for i in range(8)]


def models(experts: str, kv_cache: str, seed: int = 0):
    precision = dataclasses.replace(FP4_EVERYWHERE, experts=experts, kv_cache=kv_cache)
    qat = qat_model(
        precision, seed=seed, config=tiny_config(head_dim=32), dtype=torch.bfloat16, device="cuda"
    )
    return qat, packed_twin(qat, precision)


def engines(packed, **overrides):
    config = engine_config(block_size=16, **overrides)
    graphed = Engine(packed, config)
    eager = Engine(packed, dataclasses.replace(config, cuda_graphs=False))
    assert graphed.graphs is not None, graphed.graphs_off
    assert eager.graphs is None and eager.graphs_off == "engine.cuda_graphs is false"
    return graphed, eager


def members(record) -> tuple[torch.Tensor, ...]:
    if isinstance(record, CompactCodes):
        return record.mantissa_bits, record.block_scale, record.global_scale
    return record.tensors()


def assert_same_completions(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.completion_ids == w.completion_ids
        assert torch.equal(g.logprobs, w.logprobs) and torch.equal(g.raw_logprobs, w.raw_logprobs)
        assert (g.routing is None) == (w.routing is None)
        if g.routing is not None:
            assert torch.equal(g.routing, w.routing)
        assert (g.guidance is None) == (w.guidance is None)
        for key, record in (g.guidance or {}).items():
            want_record = w.guidance[key]
            if record is None:
                assert want_record is None
                continue
            assert type(record) is type(want_record)
            for a, b in zip(members(record), members(want_record), strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key


@RECORDED_ENGINES
@torch.no_grad()
def test_graphed_steps_equal_eager_steps_bitwise(experts, kv_cache, guidance):
    _, packed = models(experts, kv_cache)
    capture = dict(capture_routing=guidance is not None, guidance=guidance)
    graphed, eager = engines(packed, **capture)
    for params in (
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(n=1, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True),
    ):
        want = eager.generate(PROMPTS, params)
        got = graphed.generate(PROMPTS, params)
        assert_same_completions(got, want)
    assert (8, guidance is not None) in graphed.graphs.graphs


@torch.no_grad()
def test_overlapped_graphed_steps_equal_steps_one_at_a_time():
    """Graphed decode steps launched before the previous step's tokens are read (those tokens
    fed from the device) give the completions and records of steps taken one at a time, bit
    for bit: with every sample running to its length, and with samples that stop (the step
    after a stop feeds that sample once more, in a row of the same bucket, and drops it)."""
    _, packed = models("nvfp4", "nvfp4")
    config = engine_config(block_size=16, capture_routing=True, guidance="full")
    overlapped = Engine(packed, config)
    one_at_a_time = Engine(packed, dataclasses.replace(config, overlap_steps=False))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = one_at_a_time.generate(PROMPTS, greedy)
    stop = (free[0].completion_ids[4], free[3].completion_ids[7])
    for params in (greedy, dataclasses.replace(greedy, stop_token_ids=stop)):
        stats = {}
        got = overlapped.generate(PROMPTS, params, stats=stats)
        assert stats["overlapped_steps"] >= 8
        assert_same_completions(got, one_at_a_time.generate(PROMPTS, params))
    assert sum(c.finish_reason == "stop" for c in got) >= 2


@pytest.mark.parametrize(
    "experts, kv_cache, early",
    [("nvfp4", "nvfp4", True), ("nvfp4", "nvfp4", False), ("bf16", "bf16", True)],
)
@torch.no_grad()
def test_dependent_launches_change_no_bit(experts, kv_cache, early, monkeypatch):
    """Decode graphs whose kernels are launched dependently (`fp4rl.kernels.dependent_launch`,
    each kernel's programs scheduled while the kernel before it finishes, or, with early
    dependents, as soon as all of its programs run) give the completions and records of plainly
    launched kernels, bit for bit."""
    if not dependent_launch.keywords(torch.device("cuda"))["PDL"]:
        pytest.skip("dependent launch needs sm_90 or newer")
    # Early dependents in every graph (16 decodes: the K/V store at exit, as from 8), or in none.
    monkeypatch.setattr(graphs, "EARLY_DEPENDENTS_MAX_BATCH", MAX_GRAPH_BATCH if early else 0)
    _, packed = models(experts, kv_cache)
    guidance = "full" if experts == "nvfp4" else None
    config = engine_config(block_size=16, capture_routing=True, guidance=guidance)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
    dependent = Engine(packed, config).generate(PROMPTS, params)
    monkeypatch.setattr(dependent_launch, "ENABLED", False)
    assert_same_completions(Engine(packed, config).generate(PROMPTS, params), dependent)


@torch.no_grad()
def test_padding_rows_write_only_the_scratch_block():
    _, packed = models("nvfp4", "nvfp4")
    graphed, _ = engines(packed)
    prompts = PROMPTS[:5]  # 5 decodes: bucket 8, three rows of padding
    assert bucket_for(5) == 8
    out = graphed.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(c.completion_ids) == 8 for c in out)
    assert (8, False) in graphed.graphs.graphs
    used = sum(-(-(len(p) + 8) // 16) for p in prompts)  # blocks the sequences held
    scratch = graphed.num_blocks
    for layer in graphed.cache.layers:
        for pages in layer.tensors():
            written = pages.flatten(1).view(torch.uint8).ne(0).any(1)
            assert not written[used:scratch].any(), "a page no sequence held was written"
            assert written[scratch], "the padding rows wrote nowhere"


@pytest.mark.parametrize("experts", ["nvfp4", "bf16"])
@torch.no_grad()
def test_padding_rows_compute_what_their_source_row_computes(experts):
    """So they route to the experts of a real row and add no expert weights to the step."""
    _, packed = models(experts, experts)
    guidance = "full" if experts == "nvfp4" else None
    graphed, eager = engines(packed, capture_routing=True, guidance=guidance)
    prompts = PROMPTS[:5]  # 5 decodes: bucket 8, three rows of padding
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert_same_completions(graphed.generate(prompts, params), eager.generate(prompts, params))
    staged = graphed.graphs.staging.numpy()
    source = int(staged[:5, graphs.CONTEXT].argmin())
    assert (staged[5:8, graphs.SLOT] == graphed.num_blocks * 16).all()
    # The last replay's logits and records, padding rows included, in the graph's memory.
    graph = graphed.graphs.graphs[(8, True)]
    assert torch.equal(graph.logits_bV[5:8], graph.logits_bV[source].expand(3, -1))
    layout, records = graph.records.layout, graph.records.rows
    for item, members in enumerate(layout.members):
        for member in range(len(members)):
            column = layout.column(records, item, member)
            same = torch.equal(column[5:8], column[source].expand_as(column[5:8]))
            assert same, f"{layout.keys[item]!r}, member {member}"


@torch.no_grad()
def test_graphs_follow_a_refit_and_stay_across_a_release_of_the_pages():
    _, packed = models("nvfp4", "nvfp4")
    new_qat, new_packed = models("nvfp4", "nvfp4", seed=1)
    graphed, _ = engines(packed)
    assert graphed.graphs_dropped is None and graphed.cache.memory is not None
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first, again, after_release = {}, {}, {}
    before = graphed.generate(PROMPTS, params, stats=first)
    decode_graph = graphed.graphs.graphs[(8, False)]
    # One graph per shape the call used: its prefill step's and the decode step's.
    shapes = len(graphed.graphs.graphs) + len(graphed.prefill_graphs.graphs)
    assert first["graphs_captured"] == shapes == 2 and first["capture_seconds"] > 0
    RefitReceiver(graphed).receive(refit_records(new_qat, policy_version=1))
    assert graphed.graphs.graphs[(8, False)] is decode_graph  # replayed, not captured again
    after = graphed.generate(PROMPTS, params, stats=again)
    assert again["graphs_captured"] == again["capture_seconds"] == 0
    _, fresh = engines(new_packed)
    assert_same_completions(after, fresh.generate(PROMPTS, params))
    assert [c.completion_ids for c in after] != [c.completion_ids for c in before]
    pages = [t.data_ptr() for layer in graphed.cache.layers for t in layer.tensors()]
    memory = graphed.cache.memory
    free_before = torch.cuda.mem_get_info()[0]
    graphed.release_kv()
    graphed.release_kv()  # released already: the graphs stay all the same
    assert graphed.cache is None and not memory.mapped
    assert torch.cuda.mem_get_info()[0] - free_before >= memory.nbytes  # given back
    with pytest.raises(RuntimeError, match="acquire_kv"):
        graphed.generate(PROMPTS, params)
    graphed.acquire_kv()
    assert graphed.graphs.graphs[(8, False)] is decode_graph
    assert [t.data_ptr() for layer in graphed.cache.layers for t in layer.tensors()] == pages
    assert all(not t.ne(0).any() for layer in graphed.cache.layers for t in layer.tensors())
    assert_same_completions(graphed.generate(PROMPTS, params, stats=after_release), after)
    assert after_release["graphs_captured"] == 0 and graphed.captures.graphs == shapes


@torch.no_grad()
def test_the_loops_peak_memory_counts_the_pages_outside_torchs_allocator():
    """The pages at reserved addresses are not torch's allocations: a loop phase
    (`fp4rl.loop.phase`) adds them to its peak while they are mapped, and not once released."""
    _, packed = models("nvfp4", "nvfp4")
    graphed, _ = engines(packed)
    pages = graphed.reserved_kv_bytes
    assert pages == graphed.cache.memory.nbytes > 0
    m, device = {}, torch.device("cuda")
    with phase(m, "rollout", device, graphed):
        graphed.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert m["peak_rollout_gib"] * 2**30 == torch.cuda.max_memory_allocated() + pages
    graphed.release_kv()
    assert graphed.reserved_kv_bytes == 0
    with phase(m, "train", device, graphed):
        torch.ones(1 << 20, device=device)
    assert m["peak_train_gib"] * 2**30 == torch.cuda.max_memory_allocated()


@torch.no_grad()
def test_graphs_go_with_the_pages_unless_kept():
    """``engine.keep_graphs=False``: the pages are plain allocations, the graphs are dropped
    with them and captured again, without an eager call for a shape captured before."""
    _, packed = models("nvfp4", "nvfp4")
    graphed, _ = engines(packed, keep_graphs=False)
    assert graphed.graphs_dropped == "engine.keep_graphs is false"
    assert graphed.cache.memory is None
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first, recaptured = {}, {}
    before = graphed.generate(PROMPTS, params, stats=first)
    shapes = first["graphs_captured"]
    graphed.release_kv()
    assert graphed.graphs is None and graphed.prefill_graphs is None
    graphed.acquire_kv()
    assert graphed.graphs is not None and not graphed.graphs.graphs
    assert_same_completions(graphed.generate(PROMPTS, params, stats=recaptured), before)
    assert recaptured["graphs_captured"] == shapes
    assert graphed.captures.graphs == 2 * shapes
    # The shapes were captured before: no eager call before their second capture.
    warmups = shapes * (graphs.CAPTURE_WARMUPS + graphs.CAPTURE_WARMUPS_SEEN)
    assert graphs.CAPTURE_WARMUPS_SEEN == 0 and graphed.captures.warmups == warmups


def test_a_float32_engine_decodes_eagerly():
    """Its expert GEMMs split on counts read on the host, which a graph cannot hold."""
    precision = dataclasses.replace(FP4_EVERYWHERE, kv_cache="bf16")
    qat = qat_model(precision, config=tiny_config(head_dim=32), dtype=torch.float32, device="cuda")
    engine = Engine(packed_twin(qat, precision), engine_config(block_size=16))
    assert engine.graphs is None and "torch.float32" in engine.graphs_off
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(c.completion_ids) == 4 for c in out)


# ---- prefill steps (`fp4rl.rollout.prefill_graphs`) -----------------------------------------

# Prompts of two tokens or more (one token is a decode), 64 tokens in all: a bucket's size.
PREFILL_PROMPTS = [[3 + i] * n for i, n in enumerate((2, 5, 9, 16, 32))]


@RECORDED_ENGINES
@torch.no_grad()
def test_graphed_prefill_equals_eager_prefill_bitwise(experts, kv_cache, guidance):
    """At a bucket's size a graphed prefill step runs the eager step's kernels on its shapes."""
    _, packed = models(experts, kv_cache)
    capture = dict(capture_routing=guidance is not None, guidance=guidance)
    graphed, eager = engines(packed, **capture)
    assert prefill_bucket(sum(map(len, PREFILL_PROMPTS))) == 64
    for params in (
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True),
    ):
        assert_same_completions(
            graphed.generate(PREFILL_PROMPTS, params), eager.generate(PREFILL_PROMPTS, params)
        )
    assert (64, 0, guidance is not None) in graphed.prefill_graphs.graphs


@RECORDED_ENGINES
@torch.no_grad()
def test_steps_that_admit_a_prompt_beside_decodes_are_graphed_and_equal_eager_ones(
    experts, kv_cache, guidance
):
    """Eight requests of different lengths through four seats: each one that finishes lets a
    waiting prompt of 13 tokens in, prefilled in a step beside the three others' decodes (16
    tokens, a bucket's size; the decode kernel over 4 slots, one a copy). Every step replays a
    graph, those mixed steps included, and the completions and records are the eager engine's
    bit for bit."""
    _, packed = models(experts, kv_cache)
    capture = dict(capture_routing=guidance is not None, guidance=guidance)
    graphed, eager = engines(packed, max_num_seqs=4, **capture)
    prompts = [[5 + i, 6 + i] * 6 + [9] for i in range(8)]
    sampling = [
        SamplingParams(temperature=i % 2, max_tokens=3 + 2 * i, seed=i, ignore_eos=True)
        for i in range(8)
    ]
    stats, eager_stats = {}, {}
    got = graphed.generate(prompts, sampling, stats=stats)
    assert_same_completions(got, eager.generate(prompts, sampling, stats=eager_stats))
    assert stats["eager_steps"] == 0 and eager_stats["eager_steps"] == eager_stats["steps"]
    mixed = (16, 4, guidance is not None)  # 16 tokens, 3 decodes in the bucket of 4
    assert mixed in graphed.prefill_graphs.graphs, list(graphed.prefill_graphs.graphs)


@pytest.mark.parametrize("experts", ["nvfp4", "bf16"])
@torch.no_grad()
def test_padded_prefill_writes_the_eager_pages_and_only_the_scratch_block(experts):
    """50 tokens in the 64-token graph: 14 padding rows. The pages of every block the
    sequences hold are those of the eager step, bit for bit; the padding wrote only the
    scratch block."""
    _, packed = models(experts, experts)
    graphed, eager = engines(packed, capture_routing=True)
    prompts = [[7] * 3, [8, 9] * 20, list(range(1, 8))]  # 3 + 40 + 7 = 50 tokens
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    got, want = graphed.generate(prompts, params), eager.generate(prompts, params)
    assert (64, 0, True) in graphed.prefill_graphs.graphs
    assert_same_completions(got, want)
    used = sum(-(-len(p) // 16) for p in prompts)  # blocks the sequences held
    scratch = graphed.num_blocks
    layers = zip(graphed.cache.layers, eager.cache.layers, strict=True)
    for layer, (mine, theirs) in enumerate(layers):
        for a, b in zip(mine.tensors(), theirs.tensors(), strict=True):
            a, b = a.flatten(1).view(torch.uint8), b.flatten(1).view(torch.uint8)
            assert torch.equal(a[:used], b[:used]), f"layer {layer}: pages differ"
            assert not a[used:scratch].ne(0).any(), "a page no sequence held was written"
            assert a[scratch].ne(0).any(), "the padding rows wrote nowhere"


@torch.no_grad()
def test_a_prompt_of_a_few_hundred_tokens_then_its_decodes():
    """One prompt of 200 tokens (the 256 bucket), decoded after: the eager engine's
    completion, and the prefill graph replayed, not captured again, by the next call."""
    _, packed = models("nvfp4", "nvfp4")
    long = dict(max_model_len=240, max_num_batched_tokens=512, kv_memory_bytes=4 << 20)
    graphed, eager = engines(packed, **long)
    prompt = [[(7 * i) % 97 + 1 for i in range(200)]]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=1, ignore_eos=True)
    assert_same_completions(graphed.generate(prompt, params), eager.generate(prompt, params))
    graph = graphed.prefill_graphs.graphs[(256, 0, False)]
    assert_same_completions(graphed.generate(prompt, params), eager.generate(prompt, params))
    assert graphed.prefill_graphs.graphs[(256, 0, False)] is graph
    graphed.release_kv()
    graphed.acquire_kv()
    assert_same_completions(graphed.generate(prompt, params), eager.generate(prompt, params))
    assert graphed.prefill_graphs.graphs[(256, 0, False)] is graph
