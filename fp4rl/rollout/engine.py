"""The rollout engine: prompts in, `Completion`s out, by continuous batching over a paged cache.

One `generate` call builds a fresh scheduler and block pool over the engine's KV storage, so
nothing from an earlier call (blocks, queues, generators) leaks into the next. Each step:
schedule, flatten the scheduled segments into one token stream, run the model with a
`PagedAttention` backend (and a `StepCapture` when routing or guidance is recorded), or on a
GPU replay a CUDA graph of the step (`fp4rl.rollout.graphs`: decode-only steps;
`fp4rl.rollout.prefill_graphs`: steps that prefill), take the logits of each segment's last
token, copy forked samples' partial blocks, sample, and retire finished sequences.

Steps overlap (`EngineConfig.overlap_steps`): a step is launched (`_launch`: forward, sampling
and the copy of its results to the host, all queued) and, when the next step is a decode of
every running sequence (`Scheduler.decode_step`), that one is launched too before the first is
read (`_land`). Its tokens are placeholders (`fp4rl.rollout.sequence.placeholder`) that the
device resolves from the previous step's samples. The results are those of steps taken one at
a time: the same sequences, positions, tokens and generators (a sequence that sampled a stop
token is fed once more and that row is dropped; only a different batch around the other rows
can reorder a reduction, as anything that changes a batch can).

What the engine needs from the model (`fp4rl.model.transformer.MoETransformer`):
``hidden_states(tokens_T, attn, capture=...)``, ``logits(h_NH)``, ``config`` (a
`fp4rl.model.config.ModelConfig`), ``plan`` (the precision plan: per-layer KV format and the
FP4 layers) and ``moe_layers`` (the order of the routing record).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.weights import load_pretrained
from fp4rl.records import Completion
from fp4rl.rollout.attention import AttentionMetadata, PagedAttention, Segment
from fp4rl.rollout.block_manager import BlockManager
from fp4rl.rollout.capture import CaptureLog, SequenceCapture, StepCapture, kept_layers
from fp4rl.rollout.config import EngineConfig, SamplingParams, check_prompts, per_prompt_params
from fp4rl.rollout.generation_config import eos_token_ids
from fp4rl.rollout.graphs import CaptureTally, DecodeGraphs, graphs_dropped, graphs_unsupported
from fp4rl.rollout.kv_cache import KVCache, num_blocks_for_budget
from fp4rl.rollout.model_layout import ModelLayout
from fp4rl.rollout.prefill_graphs import PrefillGraphs, graphable_prefill
from fp4rl.rollout.read_back import bad_rows, check_logits, queue_read_back, read_back
from fp4rl.rollout.rows import HostRows
from fp4rl.rollout.sampler import Draws, SampleOutput, make_generator, sample, to_device
from fp4rl.rollout.scheduler import Group, Scheduler, Step
from fp4rl.rollout.sequence import Sequence, placeholder, resolve_placeholders


class Engine:
    def __init__(self, model, config: EngineConfig, *, eos_token_ids: tuple[int, ...] = ()):
        self.model, self.config = model, config
        self.layout = ModelLayout.of(model)
        if config.max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"engine.max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={model.config.max_position_embeddings}"
            )
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_blocks = num_blocks_for_budget(config, self.layout.kv)
        self.cache: KVCache | None = None
        self.host_rows = HostRows()  # where each call's captured rows land, call after call
        # Why every step runs eagerly, or None when decode and prefill steps replay CUDA graphs.
        self.graphs_off = graphs_unsupported(self.layout, config)
        # Why `release_kv` drops the graphs (None: they are kept, over pages at reserved
        # addresses), or None where there are no graphs to keep.
        self.graphs_dropped = None if self.graphs_off else graphs_dropped(self.layout, config)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.captures = CaptureTally()  # every graph this engine captured, across releases
        self._unmapped: KVCache | None = None  # the pages while released, graphs kept
        self.acquire_kv()
        if config.guidance is not None and not self.layout.guided_keys:
            raise ValueError(
                f"engine.guidance={config.guidance!r} records FP4 sites, but the model's precision "
                "plan has no guided FP4 site (precision.experts='bf16', or guided_sites empty)"
            )
        # The guided sites this engine records: all of them ("full", "sparse"), or those of the
        # latter FP4 layers ("compact").
        kept = kept_layers(config.guidance, self.layout.fp4_layers, config.compact_fraction)
        self.kept_keys = frozenset(k for k in self.layout.guided_keys if k[0] in kept)
        self.policy_version = 0  # the refit bumps it with every weight update
        # Why `generate` refuses to run, or None: set by the refit (`fp4rl.refit`) while weights
        # stream in and after a refit that failed, cleared when a whole refit was applied.
        self.invalid: str | None = None

    @classmethod
    def from_pretrained(
        cls,
        path,
        config: EngineConfig,
        *,
        precision: PrecisionConfig | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> Engine:
        """An engine over a local HF checkpoint: FP4 experts quantized from the weights cast
        to ``dtype`` and held packed, EOS ids from the checkpoint. ``precision`` is the model's
        `PrecisionConfig` (default `PrecisionConfig()`); it decides the KV format per layer."""
        model = load_pretrained(path, precision, fp4_experts="packed", dtype=dtype, device=device)
        return cls(model, config, eos_token_ids=eos_token_ids(path))

    def release_kv(self) -> None:
        """Give the KV pages' memory back (a colocated trainer needs it while it runs);
        `generate` refuses to run until `acquire_kv`. Nothing else holds the pages between
        calls. The CUDA graphs stay, and their memory pool with them, where the pages lie at
        reserved addresses (``engine.keep_graphs``; `graphs_dropped` says why not); otherwise
        they go too, since they hold the pages' addresses. The host memory kept for captured
        rows (`HostRows`) goes back too. Released already, a no-op."""
        if self.cache is not None and self.cache.memory is not None:
            self.cache.memory.unmap()
            self._unmapped, self.cache = self.cache, None
        elif self.cache is not None:
            self.cache = self.graphs = self.prefill_graphs = None
        self.host_rows.release()

    @property
    def reserved_kv_bytes(self) -> int:
        """Bytes of KV pages mapped at reserved addresses now: memory outside torch's caching
        allocator, so absent from ``torch.cuda.memory_allocated``; 0 while the pages are
        released or where they are torch's own allocations."""
        memory = None if self.cache is None else self.cache.memory
        return 0 if memory is None else memory.nbytes

    def acquire_kv(self) -> None:
        """Allocate the KV pages (again): zeroed, the size ``engine.kv_memory_bytes`` bought,
        plus one scratch block that the padding rows of graphed steps write to; at the
        addresses they had, where the graphs were kept."""
        if self.cache is None and self._unmapped is not None:
            self._unmapped.memory.map()
            self.cache, self._unmapped = self._unmapped, None
        if self.cache is None:
            c = self.config
            self.cache = KVCache(
                self.layout.kv,
                self.num_blocks + 1,
                c.block_size,
                self.layout.device,
                reserved=self.graphs_off is None and self.graphs_dropped is None,
            )
            if self.graphs_off is None:
                self.graphs = DecodeGraphs(
                    self.model,
                    self.cache,
                    device=self.layout.device,
                    max_batch=c.max_num_seqs,
                    max_model_len=c.max_model_len,
                    tally=self.captures,
                )
                self.prefill_graphs = PrefillGraphs(
                    self.model,
                    self.cache,
                    device=self.layout.device,
                    max_segments=c.max_num_seqs,
                    max_model_len=c.max_model_len,
                    pool=self.graphs.pool,
                    tally=self.captures,
                )

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams],
        *,
        stats: dict | None = None,
        on_finish=None,
        first_prompt_index: int = 0,
    ) -> list[Completion]:
        """Complete every prompt ``n`` times; results ordered by (prompt, sample).

        ``sampling``: one `SamplingParams` for every prompt, or a list of one per prompt (its
        own ``n``, temperature, limits, stop tokens and seed). A prompt's samples draw from
        generators seeded by (its params' seed, its index, the sample's index), so with a seed
        a completion does not depend on what else the call holds; ``seed=None`` draws a fresh
        seed, one per call for a single `SamplingParams`, one per prompt for a list.

        ``stats`` (optional dict) receives counters: ``steps``, ``preemptions``,
        ``prefill_tokens``, ``decode_tokens``, ``overlapped_steps`` (steps launched before
        the previous step's tokens were read, `EngineConfig.overlap_steps`; their decode tokens
        include the rows of sequences that had just sampled a stop token) and ``eager_steps``
        (steps run eagerly rather than replayed from a CUDA graph: every step where graphs are
        off, else steps of more tokens than a prefill graph takes), ``graphs_captured`` and
        ``capture_seconds`` (the CUDA graphs this call captured on first use of their shapes, and
        the wall time that took; with ``engine.keep_graphs`` off, `Engine.release_kv` drops
        every graph). ``on_finish`` (optional) is called with the number of samples that
        finished, after each step that finished any (progress bars).
        ``first_prompt_index``: this call's prompts are those of a larger request from that
        index on (one rank's share of it); prompt ``i`` seeds its generators with index
        ``first_prompt_index + i``, so a request split across engines samples what one engine
        given all of it would. ``Completion.prompt_index`` stays ``i``.
        """
        if self.invalid is not None:
            raise RuntimeError(
                f"engine weights are not usable: {self.invalid}; no generation on stale or "
                "partial weights until a refit succeeds"
            )
        if self.cache is None:
            raise RuntimeError("the engine's KV pages were released; call acquire_kv() first")
        check_prompts(prompts, self.config.max_model_len, self.layout.vocab_size)
        per_prompt = per_prompt_params(sampling, len(prompts))
        capturing = self.config.capture_routing or self.config.guidance is not None
        scheduler = Scheduler(self.config, BlockManager(self.num_blocks, self.config.block_size))
        seq_id = 0
        for i, (prompt, (params, seed)) in enumerate(zip(prompts, per_prompt, strict=True)):
            stop = frozenset(params.stop_token_ids)
            if not params.ignore_eos:
                stop |= frozenset(self.eos_token_ids)
            seqs = [
                Sequence(
                    seq_id=seq_id + j,
                    prompt_index=i,
                    sample_index=j,
                    prompt_ids=list(prompt),
                    params=params,
                    draws=Draws(make_generator(seed, first_prompt_index + i, j)),
                    stop_ids=stop,
                    capture=SequenceCapture() if capturing else None,
                )
                for j in range(params.n)
            ]
            seq_id += params.n
            scheduler.add(Group(seqs))
        counters = dict.fromkeys(
            ("steps", "preemptions", "prefill_tokens", "decode_tokens", "overlapped_steps",
             "eager_steps"), 0
        )  # fmt: skip
        log = CaptureLog(self.host_rows) if capturing else None
        captured_before = (self.captures.graphs, self.captures.seconds)
        done: list[Sequence] = []
        with torch.inference_mode():
            launched = None  # a step on the device whose tokens the host has not read yet
            while True:
                # The next decode step goes to the device before this one's tokens are read,
                # its tokens taken from this step's samples where they lie.
                ahead = None
                if launched is not None and self.config.overlap_steps:
                    step = scheduler.decode_step()
                    ahead = None if step is None else self._launch(step, scheduler, launched)
                if launched is not None:
                    finished = self._land(launched, scheduler, log)
                    done += finished
                    if on_finish is not None and finished:
                        on_finish(len(finished))
                counters["overlapped_steps"] += ahead is not None
                if ahead is None:
                    if not scheduler.has_work():
                        break
                    step = scheduler.schedule()
                    if not step.prefills and not step.decodes:
                        raise RuntimeError("scheduler made no progress (a bug: one sequence fits)")
                    ahead = self._launch(step, scheduler, None)
                launched = ahead
                counters["steps"] += 1
                counters["preemptions"] += launched.step.num_preempted
                counters["decode_tokens"] += len(launched.step.decodes)
                counters["prefill_tokens"] += launched.step.num_prefill_tokens
                counters["eager_steps"] += not launched.graphed
            records = [(None, None)] * len(done)
            if log is not None:
                layout = self.layout
                records = log.assemble([s.capture for s in done], layout.moe_layers, layout.top_k)
            completions = [
                self._completion(seq, *record) for seq, record in zip(done, records, strict=True)
            ]
        counters["graphs_captured"] = self.captures.graphs - captured_before[0]
        counters["capture_seconds"] = self.captures.seconds - captured_before[1]
        if stats is not None:
            for key, value in counters.items():
                stats[key] = stats.get(key, 0) + value
        return sorted(completions, key=lambda c: (c.prompt_index, c.sample_index))

    def _launch(self, step: Step, scheduler: Scheduler, previous: _Launched | None) -> _Launched:
        """Queue ``step``'s forward and its sampling on the device, nothing read back: each
        sampled sequence holds its new token as a placeholder (`Sequence.reserve`), and one
        that reaches its length limit with it leaves the scheduler now. Tokens still held as
        placeholders are read from ``previous``'s samples on the device."""
        # Segments in stream order: prefills (one per group, fed by its leader: a chunk or the
        # rest of its tokens), then decodes. A group samples in the step of its last chunk.
        fed = [(g.seqs[0], g.seqs, g.num_new, g.last) for g in step.prefills]
        fed += [(s, [s], 1, True) for s in step.decodes]
        segments, tokens, ranges = [], [], []
        for seq, _, num_new, _ in fed:
            new = seq.tokens_from(seq.num_cached)[:num_new]
            # The table itself: nothing changes it until the next schedule.
            segments.append(Segment(seq.block_table, seq.num_cached, len(new)))
            ranges.append((len(tokens), len(tokens) + len(new)))
            tokens += new
        device = torch.device(self.layout.device)
        sampled_before = (
            None if previous is None or previous.out is None else previous.out.token_ids_B
        )
        capture = None
        if any(seq.capture is not None for seq, *_ in fed):
            capture = StepCapture(
                routing=self.config.capture_routing,
                guidance=self.config.guidance,
                keep=self.kept_keys,
                sparse_delta=self.config.sparse_delta,
            )
        graphed = True
        if self.graphs is not None and not step.prefills and self.graphs.handles(len(fed)):
            logits_SV, capture = self.graphs.run(
                segments, tokens, capture, sampled_before, into=self.host_rows
            )
        else:
            prefill_graphed = (
                self.prefill_graphs is not None
                and sampled_before is None
                and graphable_prefill(segments)
            )
            graphed = prefill_graphed
            if prefill_graphed:
                h_TH, capture = self.prefill_graphs.run(segments, tokens, capture, self.host_rows)
            else:
                meta = AttentionMetadata.build(segments, self.config.block_size, device)
                tokens_T = resolve_placeholders(
                    to_device(torch.tensor(tokens, dtype=torch.long), device), sampled_before
                )
                attn = PagedAttention(self.cache, meta)
                h_TH = self.model.hidden_states(tokens_T, attn, capture=capture)
            last_rows = [end - 1 for (_, end), entry in zip(ranges, fed, strict=True) if entry[3]]
            last_rows = to_device(torch.tensor(last_rows, dtype=torch.long), device)  # maybe none
            logits_SV = self.model.logits(h_TH[last_rows], dtype=None)  # the sampler's input
            if capture is not None and not prefill_graphed and device.type == "cuda":
                capture = capture.to_host(into=self.host_rows)  # off the GPU now, as graphed ones
        self.cache.copy_blocks(step.block_copies)
        scheduler.commit(step)
        launched = _Launched(step, fed, ranges, len(tokens), capture, graphed)

        # Every sequence of a group samples from its leader's row with its own draws.
        launched.groups = [group for _, group, _, last in fed if last]
        seqs = [s for group in launched.groups for s in group]
        launched.seqs = seqs
        if not seqs:
            return launched  # a step of prefill chunks only
        # Nothing here waits for the device: the sampler's kernels queue behind the forward
        # while the host is still launching them.
        launched.bad_S = bad_rows(logits_SV)
        rows = to_device(
            torch.tensor([i for i, group in enumerate(launched.groups) for _ in group]), device
        )
        launched.out = sample(logits_SV[rows], [s.params for s in seqs], [s.draws for s in seqs])
        launched.read_back = queue_read_back(launched.bad_S, launched.out)
        for i, seq in enumerate(seqs):
            if seq.reserve(placeholder(i), self.config.max_model_len):
                scheduler.finish(seq)  # its last token, whatever it is: no step feeds it
        return launched

    def _land(self, launched: _Launched, scheduler: Scheduler, log: CaptureLog | None):
        """Read a launched step's tokens back (the one wait for the device), record its
        captures and put its tokens in their sequences; the sequences that finished. A
        sequence already finished by a stop token sampled in the step before this one was fed
        by it all the same (the step was launched before that token was read): its row, token
        and records are dropped."""
        live = [seq.finish_reason is None for seq, *_ in launched.fed]
        if launched.capture is not None:  # a prompt's rows belong to each of its samples
            spans = [
                (s.capture, start, end)
                for (start, end), (_, group, *_), ok in zip(
                    launched.ranges, launched.fed, live, strict=True
                )
                if ok
                for s in group
            ]
            log.add(launched.capture, launched.num_rows, spans)
        if not launched.seqs:
            return []
        bad, tokens, logprobs, raws = read_back(
            launched.read_back, launched.bad_S.shape[0], len(launched.seqs)
        )
        check_logits(bad, launched.groups)
        finished = []
        for seq, token, logprob, raw in zip(launched.seqs, tokens, logprobs, raws, strict=True):
            if seq.finish_reason is not None:
                continue
            if seq.resolve(token, logprob, raw, self.config.max_model_len):
                scheduler.finish(seq)
                finished.append(seq)
        return finished

    def _completion(self, seq: Sequence, routing, guidance) -> Completion:
        """``seq``'s completion with its records (`CaptureLog.assemble`; None, None when the
        engine records nothing)."""
        want_logprobs = seq.params.return_logprobs
        if not self.config.capture_routing:
            routing = None
        if self.config.guidance is None:
            guidance = None
        else:
            # Layers compact mode drops are marked None: the trainer rounds them to nearest by
            # intent, while a key that is simply absent still fails closed.
            missing = [key for key in self.layout.guided_keys if key not in guidance]
            guidance = guidance.with_others(dict.fromkeys(missing))
        return Completion(
            prompt_index=seq.prompt_index,
            sample_index=seq.sample_index,
            prompt_ids=tuple(seq.prompt_ids),
            completion_ids=tuple(seq.completion_ids),
            finish_reason=seq.finish_reason,
            policy_version=self.policy_version,
            logprobs=torch.tensor(seq.logprobs, dtype=torch.float32) if want_logprobs else None,
            raw_logprobs=(
                torch.tensor(seq.raw_logprobs, dtype=torch.float32) if want_logprobs else None
            ),
            routing=routing,
            guidance=guidance,
        )


@dataclass(eq=False, slots=True)
class _Launched:
    """A step whose forward and sampling are queued on the device, not yet read back."""

    step: Step
    fed: list  # (sequence that feeds, its group, tokens fed, whether the group samples)
    ranges: list[tuple[int, int]]  # each fed sequence's rows
    num_rows: int
    capture: StepCapture | None
    graphed: bool  # replayed from a CUDA graph
    groups: list[list[Sequence]] = field(default_factory=list)  # the groups that sample
    seqs: list[Sequence] = field(default_factory=list)  # the sampler's rows, in order
    bad_S: torch.Tensor | None = None
    out: SampleOutput | None = None
    read_back: tuple | None = None  # `queue_read_back`'s host tensor and event
