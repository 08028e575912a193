"""The BF16 rollout engine against Hugging Face transformers' ``generate``: same weights, same
prompts, greedy, on one GPU.

    python benchmarks/hf_generate.py     # one H200: 12 layers of the Qwen3-30B-A3B shape
    python benchmarks/hf_generate.py --device cpu --layers 2 --hidden 64 --prompt-len 16 \\
        --max-tokens 4 --batches 1 2 --repeats 1      # smoke check

One model of random BF16 weights (std 0.02, norms 1) shaped like Qwen3-30B-A3B and cut to
``--layers``: BF16 routed experts and BF16 KV in fp4rl's engine (`fp4rl.rollout.Engine`, CUDA
graphs on where the engine supports them), and the same tensors in transformers'
``Qwen3MoeForCausalLM`` (BF16, its experts through ``set_experts_implementation("grouped_mm")``),
put there through fp4rl's one hub name table (`fp4rl.model.checkpoint.fp4rl_to_hf`) and
transformers' own loader, which must report nothing missing, unexpected or mismatched.

For each batch size, ``batch`` random prompts of ``--prompt-len`` tokens (the same for both, no
padding) are completed greedily with exactly ``--max-tokens`` new tokens each: the engine with
``ignore_eos``, transformers with ``min_new_tokens = max_new_tokens`` (and no EOS id declared).
Each generator makes one full-length warm-up call of the very call timed, then ``--repeats``
timed calls, each a synchronized wall clock around the whole call (prefill included); reported
is the median (± half the spread), generated tokens/s, and the engine's speed over each
transformers setup. transformers runs under ``torch.inference_mode`` with each cache of
``--hf-cache``: ``dynamic`` (its default) and ``static`` (on CUDA its generate then compiles
the decode step with torch.compile, CUDA graphs included); the engine's ratio is quoted against
the faster one. A setup that raises is reported as failed with its error; the others still run.
The engine returns no logprobs here, as greedy ``generate`` computes none, and keeps its
default step budget (8192 tokens: 64 prompts of 512 are prefilled in four steps);
transformers prefills the whole batch in one forward. Below the table, each batch's engine call
is split: its prompt and first token (a call of one new token, timed the same way) and the
decode steps after it (the rest of the call over the ``--max-tokens`` - 1 steps).

Correctness, beside the speed: the share of generated tokens equal to the engine's at the same
row and position, whether each row's first generated token agrees, and the mean length of the
common prefix. The two compute in different orders in BF16 (kernels, fused vs separate steps),
and near-uniform random weights make argmax near-ties common, so a row can part ways after a
near-tie and never meet again: these are reported, not required to be 100 %.

Issue 11's goal for this table: the engine at least 10x transformers at batch 1, 5x at batch 64.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
from _timing import report, run_header

from fp4rl.model.checkpoint import fp4rl_to_hf
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import qwen3_30b_a3b
from fp4rl.model.transformer import build_model
from fp4rl.rollout import Engine, EngineConfig, SamplingParams
from fp4rl.rollout.model_layout import ModelLayout

try:
    import transformers
except ImportError:
    raise SystemExit(
        "hf_generate.py compares against transformers: pip install 'fp4rl[dev]'"
    ) from None

BLOCK = 16  # KV tokens per engine block
HF_CACHES = ("dynamic", "static")


def random_model(config, device: str) -> torch.nn.Module:
    """fp4rl's model with BF16 routed experts and BF16 KV, random weights (std 0.02, norms 1)."""
    precision = PrecisionConfig(
        experts="bf16", kv_cache="bf16", bf16_first_layers=0, bf16_last_layers=0
    )
    model = build_model(config, precision, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return model


def hf_twin(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """transformers' Qwen3MoeForCausalLM holding ``model``'s weights, experts on grouped_mm.

    Loaded through transformers' own ``from_pretrained`` from the hub-named view of the state
    dict (fp4rl's name table), so its loader fuses the per-expert tensors as it would a
    checkpoint's. Loaded on the CPU, then moved: placing it straight on the GPU would take
    ``device_map``, which needs the accelerate package.
    """
    config = model.config
    hf_config = transformers.Qwen3MoeConfig.from_dict(config.to_hf_dict())
    hf, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        None,
        config=hf_config,
        state_dict=fp4rl_to_hf(model.state_dict(), config),
        dtype=torch.bfloat16,
        output_loading_info=True,
    )
    wrong = {k: v for k, v in info.items() if v}
    if wrong:  # transformers would have filled what it missed with fresh random values
        raise RuntimeError(f"transformers did not load fp4rl's weights as they are: {wrong}")
    if not hasattr(hf, "set_experts_implementation"):
        raise SystemExit(
            f"transformers {transformers.__version__} has no set_experts_implementation; this "
            "benchmark compares against its grouped_mm experts: install a transformers that has "
            "it (5.17 does)"
        )
    hf.set_experts_implementation("grouped_mm")
    return hf.to(device).eval()


def make_engine(model: torch.nn.Module, batch: int, max_len: int) -> Engine:
    """An engine whose KV budget holds exactly ``batch`` sequences of ``max_len`` tokens."""
    per_seq = -(-max_len // BLOCK)
    per_block = ModelLayout.of(model).kv.bytes_per_token() * BLOCK
    config = EngineConfig(
        kv_memory_bytes=batch * per_seq * per_block,
        max_model_len=per_seq * BLOCK,
        max_num_seqs=batch,
        block_size=BLOCK,
    )
    return Engine(model, config)


def engine_generate(engine: Engine, prompts_BP: torch.Tensor, new: int) -> Callable:
    sampling = SamplingParams(
        max_tokens=new, temperature=0.0, ignore_eos=True, return_logprobs=False
    )
    prompts = prompts_BP.tolist()

    def run() -> torch.Tensor:
        out = engine.generate(prompts, sampling)
        return torch.tensor([c.completion_ids for c in out])

    return run


def hf_generate(hf: torch.nn.Module, prompts_BP: torch.Tensor, new: int, cache: str) -> Callable:
    ids_BP = prompts_BP.to(hf.device)
    generation = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        eos_token_id=None,
        pad_token_id=0,  # never written: equal prompt lengths and no early stop
        cache_implementation=None if cache == "dynamic" else cache,
    )

    def run() -> torch.Tensor:
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids_BP,
                attention_mask=torch.ones_like(ids_BP),
                generation_config=generation,
            )
        return out[:, prompts_BP.shape[1] :].cpu()

    return run


def time_calls(run: Callable, repeats: int, sync: Callable) -> tuple[list[float], torch.Tensor]:
    """Seconds of ``repeats`` calls after one warm-up call, and the last call's tokens."""
    run()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        tokens = run()
        sync()
        times.append(time.perf_counter() - start)
    return times, tokens


def agreement(tokens_BN: torch.Tensor, engine_BN: torch.Tensor) -> tuple[float, int, float]:
    """(share of equal tokens, rows whose first token is equal, mean common-prefix length)."""
    equal_BN = tokens_BN == engine_BN
    prefix_B = equal_BN.int().cumprod(dim=1).sum(dim=1)
    return equal_BN.float().mean().item(), int(equal_BN[:, 0].sum()), prefix_B.float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median reported)")
    parser.add_argument("--hf-cache", nargs="+", choices=HF_CACHES, default=list(HF_CACHES))
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke check")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke checks)")
    args = parser.parse_args()
    for key in ("layers", "prompt_len", "max_tokens", "repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if min(args.batches) < 1:
        parser.error(f"--batches must all be >= 1, got {args.batches}")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    shrink = (
        {}
        if args.hidden is None
        else dict(
            hidden_size=args.hidden, vocab_size=1024, num_experts=16, moe_intermediate_size=64
        )
    )
    max_len = args.prompt_len + args.max_tokens
    config = qwen3_30b_a3b(
        num_hidden_layers=args.layers, max_position_embeddings=max(4096, max_len), **shrink
    )
    torch.manual_seed(0)
    model = random_model(config, args.device)
    hf = hf_twin(model, args.device)
    progress(f"models built; transformers attention: {hf.config._attn_implementation}")
    g = torch.Generator().manual_seed(0)
    rows, summary = [], []
    for batch in args.batches:
        prompts_BP = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=g)
        batch_rows, best, split = compare(model, hf, prompts_BP, args, sync)
        rows += batch_rows
        summary.append(f"batch {batch}: {split}")
        if best is not None:
            summary.append(
                f"batch {batch}: engine {best[1]:.2f}x transformers ({best[0]} cache, the faster)"
            )
        if args.device == "cuda":
            torch.cuda.empty_cache()
    report(
        "hf_generate.md",
        [
            run_header("python benchmarks/hf_generate.py " + " ".join(sys.argv[1:])),
            "",
            f"{args.layers} layers, prompts of {args.prompt_len} tokens, {args.max_tokens} new "
            "tokens each, greedy; transformers "
            f"{transformers.__version__}, experts grouped_mm, attention "
            f"{hf.config._attn_implementation}",
            "",
            "| batch | generator | seconds | generated tok/s | engine speed-up "
            "| tokens equal to the engine's | first token equal | common prefix (tokens) |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            *summary,
        ],
    )


def compare(model, hf, prompts_BP: torch.Tensor, args, sync) -> tuple[list[str], tuple | None, str]:
    """One batch's table rows: the engine, then each transformers cache setup against it;
    ``(cache, engine speed-up)`` of the fastest transformers setup (None if every one failed);
    and the engine's call split into its prompt with the first token (a call of one new token,
    timed alike) and the decode steps after it."""
    batch, new = prompts_BP.shape[0], args.max_tokens
    engine = make_engine(model, batch, prompts_BP.shape[1] + new)
    times, engine_BN = time_calls(engine_generate(engine, prompts_BP, new), args.repeats, sync)
    first, _ = time_calls(engine_generate(engine, prompts_BP, 1), args.repeats, sync)
    whole, prompt = statistics.median(times), statistics.median(first)
    split = (
        f"the engine's call, {1e3 * whole:.1f} ms: the prompt and first token {1e3 * prompt:.1f} ms"
    )
    if new > 1:
        split += f", then {1e3 * (whole - prompt) / (new - 1):.2f} ms per decode step"
    graphs = "CUDA graphs" if engine.graphs_off is None else f"eager: {engine.graphs_off}"
    del engine
    check_shape("engine", engine_BN, batch, new)
    engine_tok_s = engine_BN.numel() / statistics.median(times)
    rows = [table_row(batch, f"fp4rl engine ({graphs})", *timing(times, engine_tok_s))]
    progress(rows[-1])
    best = None
    for cache in args.hf_cache:
        name = f"transformers generate, {cache} cache"
        try:
            times, hf_BN = time_calls(hf_generate(hf, prompts_BP, new, cache), args.repeats, sync)
        except Exception as error:  # a setup this model or version does not support
            traceback.print_exc()
            first_line = (str(error).splitlines() or [""])[0]
            rows.append(table_row(batch, name, f"failed: {type(error).__name__}: {first_line}"))
            progress(rows[-1])
            continue
        check_shape(name, hf_BN, batch, new)
        speedup = engine_tok_s / (hf_BN.numel() / statistics.median(times))
        equal, first, prefix = agreement(hf_BN, engine_BN)
        rows.append(
            table_row(
                batch,
                name,
                *timing(times, hf_BN.numel() / statistics.median(times)),
                f"{speedup:.2f}x",
                f"{100 * equal:.1f}%",
                f"{first}/{batch}",
                f"{prefix:.1f}",
            )
        )
        progress(rows[-1])
        if best is None or speedup < best[1]:
            best = (cache, speedup)
    return rows, best, split


def timing(times: list[float], tok_s: float) -> tuple[str, str]:
    """The seconds cell (median ± half the spread) and the tokens/s cell."""
    seconds = statistics.median(times)
    return f"{seconds:.3f} ±{50 * (max(times) - min(times)) / seconds:.0f}%", f"{tok_s:,.0f}"


def table_row(batch: int, name: str, *cells: str) -> str:
    """One row of the table's 8 columns, the cells not given left empty."""
    cells = (*cells, *[""] * (6 - len(cells)))
    return "| " + " | ".join((str(batch), name, *cells)) + " |"


def check_shape(name: str, tokens: torch.Tensor, batch: int, new: int) -> None:
    if tuple(tokens.shape) != (batch, new):
        raise RuntimeError(
            f"{name} generated {tuple(tokens.shape)} tokens, expected {batch} rows of {new}"
        )


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
