"""A run over two gloo ranks (torchrun, FSDP2 trainer, one engine per rank) against one process
with the same global batch and seeds; its checkpoint (sharded optimizer state) resumed on one
process, and one process's checkpoint resumed on two ranks.

What is held equal, and how closely:

- every sampled token, hence every reward, count and held-out accuracy: exactly. Each rank's
  engine seeds a prompt's samples by the prompt's index in the step, not in its share;
- the BF16 weights: bit for bit; the FP32 masters to 1e-7 absolute, Adam's moments to 1e-6 of
  each tensor's largest magnitude. The test's micro-batch is one group (a prompt's samples,
  which stay on one rank), so each micro-batch's BF16 gradient is the same tensor on a rank as
  in one process. One process adds the K micro-batches' gradients into the FP32 master gradient
  one after the other; the ranks reduce once per update (``run.gradient_sync = "update"``):
  each sums its own micro-batches in FP32, and the reduce-scatter adds the ranks' sums. The
  same terms, grouped by rank. A sum of K BF16 values (8 significant bits) in FP32 (24) is
  exact, and then independent of the grouping, while their magnitudes span less than about
  2^(16 - log2 K); where they span more (a router weight whose gradient is large in one
  micro-batch and tiny in another), the two groupings round apart by at most (K - 1) 2^-24 of
  the sum of the terms' magnitudes. Measured over this test's 4 updates: 3 of the 512 masters
  of one router, by at most 3.7e-9, and moments by at most 1.1e-8 of their tensor's largest
  magnitude; the bounds above leave 27x and 90x (1e-7 is 1e-4 of one Adam step at lr 1e-3).
  A BF16 weight differs only where its master sits that close to a rounding midpoint (about
  1e-5 odds for each master that differs), so the weights are held bit for bit, and with them
  every sampled token. (Reduced in every micro-batch, the grouping is by micro-batch instead;
  tests/test_distributed_sync.py compares both with one process.) Micro-batches split
  elsewhere than the single process's would differ by the BF16 rounding of their gradients
  (docs/scaling.md);
- the loss, the objective's means and the gradient norm: to 1e-6 relative. They are FP32 sums
  of the same terms grouped by rank (and, for the norm, by shard) before they are added;
- the observed mismatch metrics (`loop.observed`): each rank observes the part of the step's
  first ``run.micro_batch_seqs`` completions it holds, and the counts, sums and maxima are
  reduced over the ranks before they are divided. Ratios of counts (code, scale and routing
  agreement, bytes per token) and the maximum |Δlogp| are then exact; the means of per-token
  terms (observed_token_mult_prob_error, observed_kl) are sums grouped by rank: to 1e-6
  relative. In the first test rank 0 holds the whole observed batch; the second spreads it
  over both ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import qat_model, tiny_config, tiny_precision

from fp4rl import checkpoints, cli, demo
from fp4rl import config as run_config
from fp4rl.distributed import Ranks
from fp4rl.loop import train
from fp4rl.model.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A random tiny model with the task's vocabulary: a few samples per group earn the format
    reward, so the steps after the first train."""
    path = tmp_path_factory.mktemp("base") / "model"
    config = tiny_config(vocab_size=16)
    save_checkpoint(qat_model(tiny_precision("nvfp4"), config=config).state_dict(), config, path)
    return path


def config_of(base: Path, run_dir: Path, steps: int, *extra: str) -> run_config.RunConfig:
    return run_config.load(
        demo.CONFIG_FILE,
        [
            f"model.path={base}",
            f"run.out_dir={run_dir}",
            "model.device=cpu",
            "model.dtype=bfloat16",  # BF16 parameters, FP32 masters
            f"run.steps={steps}",
            "run.checkpoint_every=2",
            "run.eval_every=2",
            "run.eval_samples=1",
            "run.threads=1",
            "run.micro_batch_seqs=8",  # one group per micro-batch, in one process as on each rank
            "run.gradient_sync=update",  # the grouping the tolerances below are argued for
            "rollout.prompts_per_step=8",  # 4 per rank
            "rollout.samples_per_prompt=8",
            "rollout.max_tokens=3",
            "task.format_reward=0.5",
            "task.num_held_out=16",
            "align.observe_every=2",
            "optim.lr=1e-3",
            "optim.warmup_steps=0",
            *extra,
        ],
    )


def torchrun(tmp_path: Path, *args: str, nproc: int = 2) -> str:
    """``torchrun --standalone --nproc-per-node NPROC -m fp4rl train ARGS``; its stdout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "-m", "fp4rl", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def config_file(config: run_config.RunConfig, tmp_path: Path) -> str:
    file = tmp_path / f"{Path(config.run.out_dir).name}.toml"
    file.write_text(run_config.to_toml(config))
    return str(file)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


EXACT = (
    "step",
    "policy_version",
    "reward",
    "response_length",
    "generated_tokens",
    "zero_variance_groups",
    "truncated",
    "trained_samples",
    "replay_fallback_tokens",
    "held_out_accuracy",
    "held_out_greedy",
    "code_agreement",
    "lr",
    "skipped",
    "updates",
)
CLOSE = (
    "loss",
    "entropy",
    "token_mult_prob_error",
    "is_ratio_mean",
    "is_weight_mean",
    "ratio_mean",
    "clip_frac_low",
    "clip_frac_high",
    "kl",
)
# The observed mismatch: ratios of counts and a maximum, exact; means of per-token terms, close.
OBSERVED_EXACT = (
    r"code_agreement(/.+)?",
    r"adjacent_share",
    r"block_scale_agreement",
    r"router_agreement/.+",
    r"observed_max_abs_dlogp",
    r".+_bytes_per_token",
)
OBSERVED_CLOSE = ("observed_token_mult_prob_error", "observed_kl", "observed_seq_abs_dlogp")


def assert_same_observed(got: dict, want: dict) -> None:
    """The observed mismatch metrics of one step, as `OBSERVED_EXACT` and `OBSERVED_CLOSE` say."""
    exact = [k for k in want if any(re.fullmatch(p, k) for p in OBSERVED_EXACT)]
    assert "code_agreement" in exact and "guidance_bytes_per_token" in exact, sorted(want)
    for key in (*exact, *OBSERVED_CLOSE):
        assert (key in got) == (key in want), (want["step"], key)
    for key in exact:
        assert got[key] == want[key], (want["step"], key)
    for key in OBSERVED_CLOSE:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-12), (want["step"], key)


def assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for key in EXACT:
            assert g.get(key) == w.get(key), (g["step"], key)
        for key in CLOSE:
            assert (key in g) == (key in w), (g["step"], key)
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-9), (g["step"], key)
        if "grad_norm" in w:
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-6), g["step"]
        if "code_agreement" in w:
            assert_same_observed(g, w)


def assert_same_checkpoint(got: Path, want: Path) -> None:
    """Weights, update counts and Adam's steps of two checkpoints bit for bit; masters and
    moments as the module docstring says."""
    weights_got = load_file(got / "model/model.safetensors")
    weights_want = load_file(want / "model/model.safetensors")
    assert weights_got.keys() == weights_want.keys()
    for name, w in weights_want.items():
        assert torch.equal(weights_got[name], w), name
    og, ow = (torch.load(c / "trainer.pt", weights_only=True)["optimizer"] for c in (got, want))
    assert og["num_updates"] == ow["num_updates"]
    for i, (g, w) in enumerate(zip(og["masters"], ow["masters"], strict=True)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-7, msg=f"master {i}")
    sg, sw = og["optimizer"]["state"], ow["optimizer"]["state"]
    assert sg.keys() == sw.keys()
    for i in sw:
        assert torch.equal(sg[i]["step"], sw[i]["step"]), f"step of master {i}"
        for key in ("exp_avg", "exp_avg_sq"):
            w = sw[i][key]
            atol = 1e-6 * float(w.abs().max())
            torch.testing.assert_close(sg[i][key], w, rtol=0, atol=atol, msg=f"{key} of {i}")


def test_two_ranks_train_as_one_process_and_resume_on_one(tmp_path, base):
    reference_dir, two_dir = tmp_path / "reference", tmp_path / "two"
    reference = train(config_of(base, reference_dir, steps=4), log=lambda _: None)
    assert all(m["trained_samples"] > 0 for m in reference[1:4])  # every step but the first

    torchrun(tmp_path, "--config", config_file(config_of(base, two_dir, steps=3), tmp_path))
    two = metrics(two_dir)
    assert_same_steps(two[:3], reference[:3])
    # One rank wrote the run directory: rank 0's metrics, a checkpoint whose optimizer state
    # is sharded (written by both ranks) beside the gathered model.
    step2 = checkpoints.checkpoint_dir(two_dir, 2)
    assert sorted(p.name for p in step2.iterdir()) == [
        "model",
        "optimizer",
        "state.json",
        "trainer.pt",
    ]
    assert sorted(p.name for p in (step2 / "optimizer").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert (
        load_file(step2 / "model/model.safetensors").keys()
        == load_file(
            checkpoints.checkpoint_dir(reference_dir, 2) / "model/model.safetensors"
        ).keys()
    )

    # The two ranks' run, extended by one step on one process (no process group): the
    # optimizer's shards are read back whole, by name.
    assert cli.main(["train", "--resume", str(two_dir), "--set", "run.steps=4"]) == 0
    resumed = metrics(two_dir)
    assert_same_steps(resumed, reference)
    assert_same_checkpoint(
        checkpoints.checkpoint_dir(two_dir, 4), checkpoints.checkpoint_dir(reference_dir, 4)
    )

    # One process's run resumed on two ranks from its checkpoint of step 2: its trainer.pt is
    # cut into each rank's shards; the steps and weights are the one process's.
    one_dir = tmp_path / "one"
    shutil.copytree(reference_dir, one_dir)
    shutil.rmtree(checkpoints.checkpoint_dir(one_dir, 4))
    torchrun(tmp_path, "--resume", str(one_dir))
    assert_same_steps(metrics(one_dir), reference)
    step4 = checkpoints.checkpoint_dir(one_dir, 4)
    assert (step4 / "optimizer").is_dir()
    want = load_file(checkpoints.checkpoint_dir(reference_dir, 4) / "model/model.safetensors")
    got = load_file(step4 / "model/model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_two_ranks_observe_one_batch_across_them_as_one_process(tmp_path, base):
    """The step's observed batch (its first run.micro_batch_seqs completions: 32 on rank 0, 16
    on rank 1) spread over both ranks: their counts and sums reduced are the single
    process's. One step: the observation of step 0 is of the base weights on both sides."""
    extra = ("run.micro_batch_seqs=48", "align.observe_every=1", "align.rounding=nearest")
    reference_dir, two_dir = tmp_path / "reference", tmp_path / "two"
    reference = train(config_of(base, reference_dir, 1, *extra), log=lambda _: None)
    torchrun(tmp_path, "--config", config_file(config_of(base, two_dir, 1, *extra), tmp_path))
    two = metrics(two_dir)
    assert [m["step"] for m in two] == [0, 1]
    assert_same_observed(two[0], reference[0])
    assert two[0]["generated_tokens"] == reference[0]["generated_tokens"]
    assert 0.5 < reference[0]["code_agreement"] < 1.0  # nearest rounding: counts that matter


def test_two_ranks_score_a_kl_term_as_one_process(tmp_path, base):
    """``grpo.kl_coef``: each rank holds half of the starting checkpoint (sharded like the
    policy, in its BF16) and scores its micro-batches, and its padding ones so that the
    collectives line up, against it. Tokens, rewards and the weights are the single process's;
    the KL is a sum grouped by rank (close). It is exactly 0 at the first update, whose policy
    is the starting checkpoint, and positive after."""
    extra = ("grpo.kl_coef=0.05",)
    reference_dir, two_dir = tmp_path / "reference", tmp_path / "two"
    lines = []
    reference = train(config_of(base, reference_dir, 3, *extra), log=lines.append)
    kl = [m["kl"] for m in reference if m.get("trained_samples")]
    assert len(kl) >= 2 and kl[0] == 0.0 and min(kl[1:]) > 0, kl
    out = torchrun(tmp_path, "--config", config_file(config_of(base, two_dir, 3, *extra), tmp_path))
    assert_same_steps(metrics(two_dir), reference)
    want = load_file(checkpoints.checkpoint_dir(reference_dir, 3) / "model/model.safetensors")
    got = load_file(checkpoints.checkpoint_dir(two_dir, 3) / "model/model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    held = r"KL reference policy: .*, frozen, ([\d.,]+) MiB of parameters held by this (\w+)"
    one = re.search(held, "\n".join(lines))
    rank = re.search(held, out)
    assert one and rank and (one[2], rank[2]) == ("process", "rank"), out[-2000:]
    whole, share = float(one[1].replace(",", "")), float(rank[1].replace(",", ""))
    assert share == pytest.approx(whole / 2, rel=0.05), (whole, share)


def test_two_ranks_take_several_steps_a_rollout_as_one_process(tmp_path, base):
    """``grpo.mini_batches=2``: the even prompts' samples, then the odd ones', each rank
    holding its share of both and scoring its later mini-batch before the first update. The
    steps and weights are the single process's, as for one update a rollout."""
    extra = ("grpo.mini_batches=2", "optim.lr=1e-2")
    reference_dir, two_dir = tmp_path / "reference", tmp_path / "two"
    reference = train(config_of(base, reference_dir, 3, *extra), log=lambda _: None)
    assert max(m.get("updates", 0) for m in reference) == 2
    assert any(m.get("updates") == 2 and m["ratio_mean"] != 1.0 for m in reference)
    torchrun(tmp_path, "--config", config_file(config_of(base, two_dir, 3, *extra), tmp_path))
    assert_same_steps(metrics(two_dir), reference)
    want = load_file(checkpoints.checkpoint_dir(reference_dir, 3) / "model/model.safetensors")
    got = load_file(checkpoints.checkpoint_dir(two_dir, 3) / "model/model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_shares_cover_every_prompt_once_in_order():
    for world in (1, 2, 3, 8):
        for num in range(world, 20):
            shares = [
                Ranks(rank=r, world_size=world, device=torch.device("cpu"), mesh=None).share(num)
                for r in range(world)
            ]
            assert [i for share in shares for i in share] == list(range(num))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
    two = Ranks(rank=1, world_size=2, device=torch.device("cpu"), mesh=None)
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step=1 cannot be shared by 2 ranks"):
        two.share(1)
