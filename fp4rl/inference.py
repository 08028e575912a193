"""Generation and held-out evaluation outside a training run, for ``fp4rl generate`` and
``fp4rl eval``.

What to load: a checkpoint directory, or a run directory's latest complete checkpoint, with the
settings of the run (its ``config.toml``) or of a config file; the task's tokenizer defaults to
the checkpoint's own files (run checkpoints carry them). Under which precision: the config's
``[precision]`` (NVFP4 experts and, as it says, NVFP4 KV) or ``"bf16"``, every layer BF16. The
engine records nothing here (no routing, no guidance): nobody trains on these samples.

Owns resolving those, reading prompt files and writing generated records. Does not own the
engine, the task, or the held-out metric (`fp4rl.loop.evaluate`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, get_args

from fp4rl.config import RunConfig, load
from fp4rl.export import resolve_source
from fp4rl.loop import evaluate, setup
from fp4rl.progress import Progress
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.tasks import Task, build_task

Precision = Literal["config", "bf16"]


def run_config(source: Path | None, config_file: Path | None, overrides=()) -> RunConfig:
    """The settings for a run or checkpoint directory ``source`` (``model.path`` set to its
    checkpoint), or of ``config_file`` alone when there is no source."""
    if source is None:
        if config_file is None:
            raise ValueError("name a run or checkpoint directory, or a config file with --config")
        return load(config_file, list(overrides))
    model_dir, run_dir = resolve_source(Path(source))
    if config_file is None:
        if run_dir is None:
            raise ValueError(
                f"{source} is a checkpoint directory: name the settings to use with it (its "
                "task, engine and precision) with --config"
            )
        config_file = run_dir / "config.toml"
    return load(config_file, [*overrides, f"model.path={json.dumps(str(model_dir))}"])


def check_precision(precision: str) -> None:
    if precision not in get_args(Precision):
        raise ValueError(f"--precision must be one of {get_args(Precision)}, got {precision!r}")


def load_engine(config: RunConfig, precision: Precision, task: Task) -> Engine:
    """The engine over ``model.path`` under ``precision``, recording nothing."""
    check_precision(precision)
    device, dtype = setup(config)
    plan = config.precision
    if precision == "bf16":
        plan = dataclasses.replace(plan, experts="bf16", kv_cache="bf16")
    engine_config = dataclasses.replace(config.engine, capture_routing=False, guidance=None)
    engine = Engine.from_pretrained(
        config.model.path, engine_config, precision=plan, dtype=dtype, device=device
    )
    vocab_size = engine.model.config.vocab_size
    if vocab_size < task.vocab_size:
        raise ValueError(
            f"the model's vocab_size={vocab_size} does not cover the task's {task.vocab_size} "
            "token ids (its tokenizer's)"
        )
    return engine


def evaluate_policy(config: RunConfig, precision: Precision, *, log=print) -> dict:
    """Held-out accuracy (sampled and greedy, `fp4rl.loop.evaluate`) of ``model.path``."""
    task = build_task(config.task, model_dir=config.model.path, log=log)
    engine = load_engine(config, precision, task)
    held_out = task.held_out()
    total = len(held_out) * (config.run.eval_samples + 1)
    with Progress(total, "eval") as bar:
        scores = evaluate(engine, task, held_out, config, on_finish=bar.update)
    return {
        "model": config.model.path,
        "precision": "bf16" if precision == "bf16" else _describe(config),
        "num_held_out": len(held_out),
        "eval_samples": config.run.eval_samples,
        **scores,
    }


def read_prompts(lines: Iterable[str], name: str, *, field: str | None) -> list[tuple[int, str]]:
    """``(line, prompt)`` of every non-blank line: the line itself when ``field`` is None, else
    the string under ``field`` of the line's JSON object. A bad line is an error naming
    ``name:line``."""
    out = []
    for line, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        if field is None:
            out.append((line, text.rstrip("\n")))
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{name}:{line}: not valid JSON ({err.msg}); --text reads plain lines"
            ) from None
        prompt = data.get(field) if isinstance(data, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{name}:{line}: no non-empty string {field!r} in {text.strip()!r}")
        out.append((line, prompt))
    if not out:
        raise ValueError(f"{name} holds no prompt")
    return out


def generate(
    config: RunConfig,
    prompts: list[tuple[int, str]],
    name: str,
    *,
    precision: Precision,
    samples: int,
    greedy: bool,
    log=print,
) -> list[dict]:
    """One record per sample: ``line`` (of the prompt in ``name``), ``sample``, ``prompt``,
    ``completion`` (text, the stop token left out), ``finish_reason`` ("stop" or "length"),
    ``completion_tokens``. Sampling follows ``[rollout]`` (temperature, max_tokens,
    cdf_order) and ``run.seed``; ``greedy`` takes the most likely token instead."""
    task = build_task(config.task, model_dir=config.model.path, log=log)
    engine = load_engine(config, precision, task)
    ids = [task.encode_prompt(text) for _, text in prompts]
    limit = engine.config.max_model_len
    for (line, _), prompt_ids in zip(prompts, ids, strict=True):
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"{name}:{line}: prompt of {len(prompt_ids)} tokens leaves no room to generate "
                f"within engine.max_model_len={limit}"
            )
    r = config.rollout
    params = SamplingParams(
        n=samples,
        temperature=0.0 if greedy else r.temperature,
        max_tokens=r.max_tokens,
        stop_token_ids=task.stop_token_ids,
        seed=config.run.seed,
        cdf_order=r.cdf_order,
    )
    with Progress(len(prompts) * samples, "generate") as bar:
        done = engine.generate(ids, params, on_finish=bar.update)
    out = []
    for c in done:
        line, text = prompts[c.prompt_index]
        completion = list(c.completion_ids)
        if c.finish_reason == "stop" and completion and completion[-1] in task.stop_token_ids:
            completion = completion[:-1]
        out.append(
            {
                "line": line,
                "sample": c.sample_index,
                "prompt": text,
                "completion": task.decode(completion),
                "finish_reason": c.finish_reason,
                "completion_tokens": len(c.completion_ids),
            }
        )
    return out


def write_jsonl(records: list[dict], output: str) -> None:
    """To stdout for ``"-"``, else to the file ``output``, whole or not at all (written beside
    it, then renamed)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if output == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(output)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"--output {output}: no directory {path.parent}")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as any new file, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _describe(config: RunConfig) -> str:
    p = config.precision
    return f"experts {p.experts}, kv_cache {p.kv_cache}"
