"""Where the trainer's forward first departs from the rollout's, op by op, on the same tokens.

    BASE=~/.cache/fp4rl/base-...   # the demo's cached base policy (`fp4rl demo` builds it)
    python benchmarks/seam_ops.py --config fp4rl/configs/demo.toml --set model.path=$BASE \\
        --set model.dtype=bfloat16 --steps 0 [--trainer-forward engine]

The engine generates one of the loop's prompt batches (full guidance recorded, so every FP4
code is known); forward hooks record, for every token of every sequence, the output of each op
of each layer on both sides: the engine's (prefill and cached decode steps, whatever batch each
step held) and the trainer's (one replayed full-sequence forward of the first
``run.micro_batch_seqs`` completions, nearest rounding). For each op the table gives the share
of token rows whose output differs bitwise, and the share of rows where it differs although
every input of the op was bitwise equal on both sides (for attention: the row's query and the
keys and values of its whole context): the op's *own* departures, where the gap is born. The
rest is inherited from an earlier op. Expert GEMMs are recorded per (token, expert) row.

Then, on the same completions, `fp4rl.train.observe`'s metrics (code agreement overall and per
site kind, adjacent share, token_mult_prob_error, KL, max |dlogp|) for each trainer forward
(`policy.FORWARDS`) with nearest and guided-full rounding, and the time of one replayed forward
+ backward of the micro-batch with each forward (median of ``--repeats``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict

import torch
from _seam import load_seam

from fp4rl.loop import sampling
from fp4rl.model import experts as experts_module
from fp4rl.records import collate
from fp4rl.rollout import Engine
from fp4rl.rollout.generation_config import eos_token_ids
from fp4rl.train.observe import observe
from fp4rl.train.policy import FORWARDS, policy_logprobs


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--steps", type=int, nargs="+", default=[0])
    parser.add_argument("--trainer-forward", default="packed", choices=FORWARDS)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


# (op name, module path in a decoder layer, which output: "out" or "in" (a pre-hook's input))
LAYER_OPS = (
    ("residual_in", "input_layernorm", "in"),
    ("input_norm", "input_layernorm", "out"),
    ("q_proj", "self_attn.q_proj", "out"),
    ("k_proj", "self_attn.k_proj", "out"),
    ("v_proj", "self_attn.v_proj", "out"),
    ("q_norm", "self_attn.q_norm", "out"),
    ("k_norm", "self_attn.k_norm", "out"),
    ("attention", "self_attn.o_proj", "in"),
    ("o_proj", "self_attn.o_proj", "out"),
    ("post_norm", "post_attention_layernorm", "out"),
    ("router_weights", "mlp.router", "out"),
    ("experts", "mlp.experts", "out"),
)
# The inputs each op reads, by op name; "attention" also reads its context's K and V rows.
INPUTS = {
    "input_norm": ("residual_in",),
    "q_proj": ("input_norm",),
    "k_proj": ("input_norm",),
    "v_proj": ("input_norm",),
    "q_norm": ("q_proj",),
    "k_norm": ("k_proj",),
    "attention": ("q_norm",),
    "o_proj": ("attention",),
    "post_norm": ("o_proj", "residual_in"),
    "router_weights": ("post_norm",),
    "gate_up": ("post_norm",),
    "down": ("gate_up",),
    "experts": ("down", "router_weights"),
}
CONTEXT_INPUTS = {"attention": ("k_norm", "v_proj")}


class Recorder:
    """Per op, per (sequence id, position) row: the output as computed. ``rows`` maps the
    current forward's token rows to the (sequence ids, position) they stand for."""

    def __init__(self) -> None:
        self.values: dict[str, dict[tuple[int, int], torch.Tensor]] = defaultdict(dict)
        self.rows: list[tuple[tuple[int, ...], int]] = []
        self._ids_Tk = None

    def put(self, name: str, x_T: torch.Tensor) -> None:
        x_T = x_T.detach().cpu()
        for (seq_ids, pos), row in zip(self.rows, x_T, strict=True):
            for s in seq_ids:
                self.values[name][(s, pos)] = row.clone()

    def hook(self, model) -> list:
        handles = []
        for layer in model.layers:
            i = layer.layer
            for op, path, which in LAYER_OPS:
                module = layer.get_submodule(path) if _has(layer, path) else None
                if module is None:
                    continue
                name = f"{i}.{op}"
                if which == "in":
                    handles.append(module.register_forward_pre_hook(self._pre(name)))
                else:
                    handles.append(module.register_forward_hook(self._post(name)))
            if _has(layer, "mlp.experts"):
                handles.append(layer.mlp.experts.register_forward_pre_hook(self._expert_ids(i)))
        handles.append(model.norm.register_forward_hook(self._post("final_norm")))
        return handles

    def _pre(self, name):
        return lambda module, args: self.put(name, _flat(args[0]))

    def _post(self, name):
        def hook(module, args, out):
            self.put(name, _flat(out[0] if isinstance(out, tuple) else out))

        return hook

    def _expert_ids(self, layer):
        def hook(module, args):
            self._ids_Tk, self._gemm = args[1], [f"{layer}.gate_up", f"{layer}.down"]

        return hook

    def grouped_mm(self, original):
        """A wrapper of the experts' grouped GEMM recording its rows as (token, slot) rows."""

        def wrapped(x_AK, w, counts_E, **gather):
            out_A = original(x_AK, w, counts_E, **gather)
            ids_Tk = self._ids_Tk
            T, k = ids_Tk.shape
            order_A = experts_module.sort_by_expert(ids_Tk, w.shape[0])
            by_token = torch.empty_like(out_A)
            by_token[order_A] = out_A
            self.put(self._gemm.pop(0), by_token.view(T, k * out_A.shape[-1]))
            return out_A

        return wrapped


def _has(module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


class RecordingEngine(Engine):
    """The engine, telling the recorder which sequences and positions each step's rows are."""

    recorder: Recorder

    def _launch(self, step, scheduler, *args):
        rows = []
        fed = [(g.seqs[0], g.seqs) for g in step.prefills] + [(s, [s]) for s in step.decodes]
        for seq, group in fed:
            ids = tuple(s.seq_id for s in group)
            start = seq.num_cached
            rows += [(ids, start + j) for j in range(len(seq.tokens_from(start)))]
        self.recorder.rows = rows
        return super()._launch(step, scheduler, *args)


def compare(engine: Recorder, trainer: Recorder):
    """Per op: (rows compared, rows differing, rows differing with equal inputs)."""
    out = {}
    for name, theirs in trainer.values.items():
        layer, op = name.split(".", 1) if "." in name else ("", name)
        if layer == "":
            layer = "0"
        ours = engine.values[name]
        counts = [0, 0, 0]
        for key, value in theirs.items():
            differs = not torch.equal(value, ours[key])
            counts[0] += 1
            counts[1] += differs
            if differs and _inputs_equal(engine, trainer, layer, op, key):
                counts[2] += 1
        out[name] = counts
    return out


def _inputs_equal(engine, trainer, layer, op, key) -> bool:
    seq, pos = key
    names = [(f"{layer}.{i}", [pos]) for i in INPUTS.get(op, ())]
    if op in ("residual_in", "final_norm"):  # the previous layer's residual sum
        before = (
            int(layer) - 1
            if op == "residual_in"
            else max(int(n.split(".")[0]) for n in trainer.values if n[0].isdigit())
        )
        names = [(f"{before}.{i}", [pos]) for i in ("residual_in", "o_proj", "experts")]
        if before < 0:
            return True
    names += [(f"{layer}.{i}", range(pos + 1)) for i in CONTEXT_INPUTS.get(op, ())]
    for name, positions in names:
        if name not in trainer.values:
            continue
        for p in positions:
            if not torch.equal(trainer.values[name][(seq, p)], engine.values[name][(seq, p)]):
                return False
    return True


VARIANTS = {
    f"{forward}, {rounding}": (forward, rounding == "guided-full")
    for forward in FORWARDS
    for rounding in ("nearest", "guided-full")
}
METRICS = (
    "code_agreement",
    "code_agreement/expert_input",
    "code_agreement/expert_hidden",
    "code_agreement/k",
    "code_agreement/v",
    "adjacent_share",
    "observed_token_mult_prob_error",
    "observed_kl",
    "observed_max_abs_dlogp",
)


def step_seconds(policy, batch, forward: str, repeats: int) -> list[float]:
    """Wall time of one replayed, nearest-rounded forward + backward of ``batch``."""
    out = []
    for _ in range(repeats):
        policy.zero_grad(set_to_none=True)
        start = time.perf_counter()
        policy_logprobs(policy, batch, guided=False, forward=forward).sum().backward()
        out.append(time.perf_counter() - start)
    policy.zero_grad(set_to_none=True)
    return out


def main() -> None:
    args = parse_args()
    config, task, policy, packed = load_seam(args.config, args.overrides)
    path = config.model.path
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    n = config.rollout.samples_per_prompt
    original = experts_module.grouped_mm
    max_dlogp = 0.0
    metrics = {name: defaultdict(list) for name in VARIANTS}
    seconds = defaultdict(list)
    for step in args.steps:
        problems = task.train_examples(
            seed=config.run.seed, step=step, num=config.rollout.prompts_per_step
        )
        prompts = [list(p.prompt_ids) for p in problems]
        engine_config = dataclasses.replace(config.engine, guidance="full")
        engine = RecordingEngine(packed, engine_config, eos_token_ids=eos_token_ids(path))
        engine.recorder = theirs = Recorder()
        handles = theirs.hook(packed)
        experts_module.grouped_mm = theirs.grouped_mm(original)
        try:
            completions = engine.generate(prompts, sampling(config, step, task.stop_token_ids))
        finally:
            experts_module.grouped_mm = original
            for h in handles:
                h.remove()
        batch = collate(completions[: config.run.micro_batch_seqs])
        ours = Recorder()
        ours.rows = [
            ((p * n + s,), pos)
            for p, s, length in zip(
                batch.prompt_index, batch.sample_index, batch.seq_lens, strict=True
            )
            for pos in range(length)
        ]
        handles = ours.hook(policy)
        experts_module.grouped_mm = ours.grouped_mm(original)
        try:
            with torch.no_grad():
                logp_N = policy_logprobs(policy, batch, guided=False, forward=args.trainer_forward)
        finally:
            experts_module.grouped_mm = original
            for h in handles:
                h.remove()
        d_N = logp_N - batch.rollout_logprobs_N
        t = totals["logprob (vs the rollout's raw logprob)"]
        t[0], t[1] = t[0] + d_N.numel(), t[1] + int((d_N != 0).sum())
        max_dlogp = max(max_dlogp, float(d_N.abs().max()))
        for name, c in compare(theirs, ours).items():
            t = totals[name]
            t[0], t[1], t[2] = t[0] + c[0], t[1] + c[1], t[2] + c[2]
        for name, (forward, guided) in VARIANTS.items():
            m = observe(policy, batch, replay=True, guided=guided, forward=forward)
            for key in METRICS:
                if key in m:
                    metrics[name][key].append(m[key])
        for forward in FORWARDS:
            seconds[forward] += step_seconds(policy, batch, forward, args.repeats)
        print(f"step {step} done", flush=True)
    print("| trainer forward, rounding | " + " | ".join(METRICS) + " |")
    print("|---|" + "---:|" * len(METRICS))
    for name, m in metrics.items():
        means = [statistics.fmean(m[k]) if m[k] else float("nan") for k in METRICS]
        # max |dlogp| is the largest over the batches, every other figure their mean
        means[-1] = max(m["observed_max_abs_dlogp"])
        print(f"| {name} | " + " | ".join(f"{v:.6g}" for v in means) + " |")
    for forward, s in seconds.items():
        print(f"forward + backward, {forward}: {statistics.median(s):.3f} s median")
    print(f"max |logp_trainer - logp_rollout|: {max_dlogp:.3g}")
    print("| op | rows differing | differing with equal inputs (born here) |")
    print("|---|---:|---:|")
    for name, (total, differ, own) in totals.items():
        born = "—" if name.startswith("logprob") else f"{100 * own / total:.2f} %"
        print(f"| {name} | {100 * differ / total:.2f} % | {born} |")


if __name__ == "__main__":
    main()
