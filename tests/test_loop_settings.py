"""Settings of the GRPO loop: ``run.keep_kv`` (the engine keeps its KV pages, and its CUDA
graphs, through the update), ``grpo.kl_coef`` (the KL term to the starting checkpoint) and
``grpo.mini_batches`` (several optimizer steps per rollout)."""

import copy
import dataclasses

import pytest
import torch
from demo_policy import base_policy, policy_and_engine, rollout_and_advantages, update

from fp4rl import config as run_config
from fp4rl import demo
from fp4rl.loop import train
from fp4rl.rollout import Engine
from fp4rl.train.optim import MasterAdamW
from fp4rl.train.step import grpo_step, grpo_update, proximal_logprobs


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_policy(tmp_path_factory.mktemp("cache"))


RELEASE_KV = Engine.release_kv


def loop_keeping_kv(base, out_dir, keep: bool, monkeypatch, *overrides):
    """A two-step run with ``run.keep_kv=keep``: its metrics and how many times the engine gave
    its pages back."""
    released = []
    monkeypatch.setattr(Engine, "release_kv", lambda e: (released.append(e), RELEASE_KV(e)))
    config = run_config.load(
        demo.CONFIG_FILE,
        [
            f"model.path={base}",
            f"run.out_dir={out_dir}",
            f"run.keep_kv={str(keep).lower()}",
            "run.steps=2",
            "run.eval_every=100",
            "rollout.prompts_per_step=8",
            "rollout.max_tokens=6",
            *overrides,
        ],
    )
    return train(config, log=lambda _: None), len(released)


def test_kept_kv_pages_change_no_step_and_are_never_given_back(tmp_path, base, monkeypatch):
    """``run.keep_kv``: the engine holds its KV pages through every update, and the run's steps
    are those of a run that gives them back, bit for bit on the CPU: the pages a rollout reads
    were written in it."""
    runs = {}
    for keep in (False, True):
        history, released = loop_keeping_kv(
            base, tmp_path / str(keep), keep, monkeypatch, "model.device=cpu"
        )
        assert released == (0 if keep else 2), keep
        assert [m["graphs_captured"] for m in history[:2]] == [0, 0]  # every CPU step eager
        # All but the wall-clock times and rates.
        runs[keep] = [{k: v for k, v in m.items() if not k.endswith("_s")} for m in history]
    assert runs[True] == runs[False]


def test_a_reference_equal_to_the_policy_adds_a_kl_of_zero_and_no_gradient(base):
    """The KL term of ``grpo.kl_coef``: against a reference that is the policy itself, every
    token's k3 is exactly 0 and so is its gradient, so the update is the plain one bit for bit;
    against another reference the KL is positive and moves the update. Without a reference,
    a clear error before any forward."""
    config, policy, engine = policy_and_engine(base, "optim.lr=1e-3")
    completions, advantages = rollout_and_advantages(config, engine, step=0)
    start = {n: p.detach().clone() for n, p in policy.named_parameters()}
    reference = copy.deepcopy(policy).requires_grad_(False)  # the policy before the update
    plain = update(config, policy, completions, advantages, micro_batch_seqs=16)
    after_plain = {n: p.detach().clone() for n, p in policy.named_parameters()}
    kl = dataclasses.replace(config.grpo, kl_coef=0.1)

    def kl_update(reference):
        with torch.no_grad():
            for n, p in policy.named_parameters():
                p.copy_(start[n])
        optimizer = MasterAdamW(policy.parameters(), config.optim)
        return grpo_update(
            policy, optimizer, completions, advantages, config=kl, replay=True, guided=True,
            temperature=1.0, micro_batch_seqs=16, reference=reference,
        )  # fmt: skip

    same = kl_update(reference)
    assert same["kl"] == 0.0 and same["loss"] == plain["loss"]
    for n, p in policy.named_parameters():
        assert torch.equal(p.detach(), after_plain[n]), n
    with torch.no_grad():  # another reference: the policy nudged
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    other = kl_update(reference)
    assert other["kl"] > 0 and other["loss"] != plain["loss"]
    with pytest.raises(ValueError, match=r"grpo.kl_coef=0.1 needs a reference policy"):
        kl_update(None)


def kl_run_config(base, out_dir):
    return run_config.load(
        demo.CONFIG_FILE,
        [
            f"model.path={base}",
            f"run.out_dir={out_dir}",
            "model.device=cpu",
            "grpo.kl_coef=0.05",
            "run.steps=3",
            "run.eval_every=100",
            "rollout.prompts_per_step=16",
            "rollout.max_tokens=6",
        ],
    )


def test_a_run_with_a_kl_term_measures_it_against_its_starting_checkpoint(tmp_path, base):
    """``grpo.kl_coef``: the loop scores every update against the checkpoint it started from,
    frozen: at the first update the policy is that checkpoint (a KL of exactly 0), after it
    the policy has moved."""
    history = train(kl_run_config(base, tmp_path / "run"), log=lambda _: None)
    kl = [m["kl"] for m in history if m.get("trained_samples")]  # the steps that updated
    assert len(kl) >= 2 and kl[0] == 0.0 and min(kl[1:]) > 0, kl


STEP = dict(replay=True, guided=True, temperature=1.0, micro_batch_seqs=16)


def weights(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


def test_proximal_scores_are_the_updates_own_bits(base):
    """`proximal_logprobs` of the policy as it is gives the bits the update's own forward
    computes: r is exactly 1 (nothing clipped), and the update equals the one without a
    proximal policy, bit for bit."""
    config, policy, engine = policy_and_engine(base, "optim.lr=1e-3")
    completions, advantages = rollout_and_advantages(config, engine, step=0)
    twin = copy.deepcopy(policy)
    plain = update(config, policy, completions, advantages, micro_batch_seqs=16)
    prox = proximal_logprobs(twin, completions, **STEP)
    assert [len(p) for p in prox] == [len(c.completion_ids) for c in completions]
    optimizer = MasterAdamW(twin.parameters(), config.optim)
    got = grpo_update(
        twin, optimizer, completions, advantages, config=config.grpo, proximal=prox, **STEP
    )
    assert got["ratio_mean"] == 1.0 and got["clip_frac_low"] == got["clip_frac_high"] == 0.0
    assert got == plain
    after, want = weights(twin), weights(policy)
    assert all(torch.equal(after[n], want[n]) for n in want)


def test_mini_batches_update_in_turn_against_the_policy_the_step_started_from(base):
    """``grpo.mini_batches=2``: the even prompts' samples update first, then the odd ones', the
    second update's ratio taken against the policy before the first (scored before it), so
    it is no longer 1. The same weights as those two updates made by hand."""
    config, policy, engine = policy_and_engine(
        base, "optim.lr=1e-2", "optim.warmup_steps=0", "grpo.mini_batches=2"
    )
    completions, advantages = rollout_and_advantages(config, engine, step=3)
    halves = [[i for i, c in enumerate(completions) if c.prompt_index % 2 == b] for b in (0, 1)]
    assert all(any(advantages[i] for i in half) for half in halves)  # both halves teach
    twin = copy.deepcopy(policy)
    optimizer = MasterAdamW(policy.parameters(), config.optim)
    got = grpo_step(policy, optimizer, completions, advantages, config=config.grpo, **STEP)
    assert got["updates"] == 2 and optimizer.num_updates == 2

    odd = [completions[i] for i in halves[1]]
    prox = proximal_logprobs(twin, odd, **STEP)  # before any update
    by_hand = MasterAdamW(twin.parameters(), config.optim)
    results = [
        grpo_update(
            twin,
            by_hand,
            [completions[i] for i in half],
            [advantages[i] for i in half],
            config=config.grpo,
            proximal=None if b == 0 else prox,
            **STEP,
        )  # fmt: skip
        for b, half in enumerate(halves)
    ]
    assert results[0]["ratio_mean"] == 1.0 and results[1]["ratio_mean"] != 1.0
    # The step's metrics weigh each update by its tokens, its optimizer's figures by step.
    tokens = [sum(len(completions[i].completion_ids) for i in half) for half in halves]
    assert tokens[0] != tokens[1]  # so that a plain mean would differ
    for key in ("ratio_mean", "loss", "entropy"):
        want = sum(t * r[key] for t, r in zip(tokens, results, strict=True)) / sum(tokens)
        assert got[key] == pytest.approx(want, rel=1e-12, abs=1e-15), key
    assert got["grad_norm"] == (results[0]["grad_norm"] + results[1]["grad_norm"]) / 2
    after, want = weights(policy), weights(twin)
    assert all(torch.equal(after[n], want[n]) for n in want)


def test_more_mini_batches_than_prompts_are_refused():
    with pytest.raises(ValueError, match=r"grpo.mini_batches=9 is more than the step's rollout"):
        run_config.load(demo.CONFIG_FILE, ["grpo.mini_batches=9", "rollout.prompts_per_step=8"])
    with pytest.raises(ValueError, match=r"grpo.mini_batches must be an int >= 1, got 0"):
        run_config.load(demo.CONFIG_FILE, ["grpo.mini_batches=0"])
