"""``fp4rl generate``: completions of prompts from a file or stdin, as JSONL."""

from __future__ import annotations

import argparse
import sys

from fp4rl.commands import add_policy_arguments

HELP = "complete prompts from a file or stdin with a checkpoint, BF16 or NVFP4; JSONL out"
DESCRIPTION = (
    "Generate with the rollout engine from a checkpoint directory, a run directory (its latest "
    "complete checkpoint and its config.toml) or the model.path of --config. Prompts are "
    "JSONL lines with the prompt under --field (default: the task's prompt_field, or 'prompt'), "
    "or plain lines with --text; they are tokenized as the task tokenizes its prompts (its chat "
    "template included). Sampling follows [rollout] (temperature, max_tokens) and run.seed. "
    "Writes one JSON object per sample: line, sample, prompt, completion, finish_reason, "
    "completion_tokens."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_policy_arguments(parser)
    parser.add_argument("--input", default="-", help="the prompts file; - for stdin (default)")
    parser.add_argument("--output", default="-", help="the JSONL file to write; - for stdout")
    parser.add_argument("--text", action="store_true", help="each input line is one prompt")
    parser.add_argument("--field", help="the prompt's key in each JSON line")
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt (default 1)")
    parser.add_argument("--greedy", action="store_true", help="the most likely token each step")


def run(args: argparse.Namespace) -> None:
    from fp4rl import inference

    inference.check_precision(args.precision)
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.text and args.field:
        raise ValueError("--text reads plain lines; --field names a key of JSON lines")
    config = inference.run_config(args.source, args.config, args.set)
    field = None if args.text else (args.field or getattr(config.task, "prompt_field", "prompt"))
    if args.input == "-":
        prompts = inference.read_prompts(sys.stdin, "<stdin>", field=field)
    else:
        with open(args.input, encoding="utf-8") as f:
            prompts = inference.read_prompts(f, args.input, field=field)
    records = inference.generate(
        config,
        prompts,
        "<stdin>" if args.input == "-" else args.input,
        precision=args.precision,
        samples=args.samples,
        greedy=args.greedy,
        log=lambda line: print(line, file=sys.stderr),
    )
    inference.write_jsonl(records, args.output)
