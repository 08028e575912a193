"""MasterAdamW against hand arithmetic and torch.optim.AdamW in FP64, the BF16 round trip of the
masters, FP32 accumulation, clipping, the LR schedule, checkpoints, and micro-batch invariance
of the whole GRPO loss + optimizer step."""

import io
import math

import pytest
import torch

from fp4rl.train.grpo import GrpoConfig, grpo_loss
from fp4rl.train.optim import MasterAdamW, OptimConfig, lr_at


def param(values, dtype=torch.float32):
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype))


def step_with(opt, grads):
    for p, g in zip(opt.params, grads, strict=True):
        p.grad = torch.as_tensor(g, dtype=p.dtype).reshape(p.shape)
    return opt.step()


def test_one_step_by_hand_decay_on_matrices_only():
    scalar, matrix = param(1.0), param([[1.0]])
    opt = MasterAdamW([scalar, matrix], OptimConfig(lr=0.1, weight_decay=0.1, max_grad_norm=None))
    out = step_with(opt, [0.5, 0.5])
    # m = 0.1 * 0.5 = 0.05, v = 0.001 * 0.25 = 2.5e-4; bias-corrected m^ = 0.5, v^ = 0.25;
    # update = lr * m^ / (sqrt(v^) + eps) = 0.1 * 0.5 / 0.5 = 0.1 (eps 1e-8: 2e-9 off)
    # scalar (no decay): 1 - 0.1 = 0.9; matrix: 1 * (1 - lr * wd) - 0.1 = 0.99 - 0.1 = 0.89
    assert scalar.item() == pytest.approx(0.9, abs=1e-7)  # FP32 ulp at 1 is 1.2e-7
    assert matrix.item() == pytest.approx(0.89, abs=1e-7)
    assert out == {"lr": 0.1, "grad_norm": pytest.approx(0.5 * math.sqrt(2)), "skipped": 0.0}
    assert scalar.grad is None and all(m.grad is None for m in opt.masters)


def test_matches_torch_adamw_in_fp64_with_schedule():
    gen = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)
    config = OptimConfig(
        lr=1e-2, min_lr=1e-3, weight_decay=0.01, max_grad_norm=None,
        schedule="cosine", warmup_steps=2, total_steps=5,
    )  # fmt: skip
    opt = MasterAdamW([torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())], config)
    ref_w, ref_b = torch.nn.Parameter(w0.double()), torch.nn.Parameter(b0.double())
    ref = torch.optim.AdamW(
        [{"params": [ref_w], "weight_decay": 0.01}, {"params": [ref_b], "weight_decay": 0.0}],
        lr=0.0, betas=(0.9, 0.999), eps=1e-8, foreach=False,
    )  # fmt: skip
    for step in range(6):
        grads = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]
        out = step_with(opt, grads)
        for group in ref.param_groups:
            group["lr"] = lr_at(step, config)
        ref_w.grad, ref_b.grad = grads[0].double(), grads[1].double()
        ref.step()
        assert out["lr"] == lr_at(step, config)
    # Six FP32 updates of size ~lr against FP64: the gap is a few FP32 ulps of the weights (~1).
    torch.testing.assert_close(opt.params[0].double(), ref_w.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.params[1].double(), ref_b.detach(), rtol=0, atol=1e-6)


def test_bf16_params_keep_fp32_masters_and_round_to_nearest():
    p = param([1.0], dtype=torch.bfloat16)
    opt = MasterAdamW([p], OptimConfig(lr=1e-3, max_grad_norm=None))
    for k in range(1, 4):
        step_with(opt, [1.0])
        # A constant gradient gives m^ / sqrt(v^) = 1: each update is lr, so master = 1 - k e-3.
        assert opt.masters[0].item() == pytest.approx(1 - k * 1e-3, abs=1e-6)
        assert p.dtype == torch.bfloat16 and torch.equal(p.data, opt.masters[0].bfloat16())
    # BF16 neighbours of 0.997: 0.99609375 (= 1 - 2^-8) and 1.0; nearest is the lower one.
    # After step 1 (0.999) the BF16 value was still 1.0: the masters kept the small updates.
    assert p.item() == 0.99609375


def test_accumulate_sums_micro_batch_grads_in_fp32():
    p = param([0.0], dtype=torch.bfloat16)
    opt = MasterAdamW([p], OptimConfig())
    for g in (1.0, 2.0**-9):
        p.grad = torch.tensor([g], dtype=torch.bfloat16)
        opt.accumulate()
        assert p.grad is None
    # 1 + 2^-9 is exact in FP32; in BF16 (8 significant bits) it would round back to 1.0.
    assert opt.masters[0].grad.item() == 1.0 + 2.0**-9


def test_clipping_by_global_norm():
    a, b = param(0.0), param(0.0)
    opt = MasterAdamW([a, b], OptimConfig(lr=0.1, max_grad_norm=1.0))
    ra, rb = torch.nn.Parameter(torch.tensor(0.0)), torch.nn.Parameter(torch.tensor(0.0))
    ref = torch.optim.AdamW([ra, rb], lr=0.1, weight_decay=0.0)
    # Step 1: norm sqrt(9 + 16) = 5 > 1 -> grads * 1/5 = [0.6, 0.8]; step 2: norm 0.5, as is.
    for grads, clipped, norm in (([3, 4], [0.6, 0.8], 5.0), ([0.3, 0.4], [0.3, 0.4], 0.5)):
        assert step_with(opt, grads)["grad_norm"] == pytest.approx(norm, rel=1e-6)
        ra.grad, rb.grad = torch.tensor(clipped[0]), torch.tensor(clipped[1])
        ref.step()
    # Unclipped, step 1 would feed 5x larger moments and step 2 would move less.
    assert (a.item(), b.item()) == pytest.approx((ra.item(), rb.item()), abs=1e-7)


def test_non_finite_grad_skips_the_update():
    p = param([1.0, 2.0])
    opt = MasterAdamW([p], OptimConfig(lr=0.1))
    out = step_with(opt, [[1.0, float("nan")]])
    assert out["skipped"] == 1.0 and math.isnan(out["grad_norm"])
    assert p.tolist() == [1.0, 2.0] and opt.num_updates == 0 and opt.masters[0].grad is None


def test_schedule_values():
    cos = OptimConfig(lr=1.0, min_lr=0.1, schedule="cosine", warmup_steps=2, total_steps=6)
    # warm-up (s + 1) / 2: 0.5, 1.0; then 0.1 + 0.9 * 0.5 * (1 + cos(pi * (s - 2) / 4))
    expected = {
        0: 0.5,
        1: 1.0,
        2: 1.0,  # progress 0
        3: 0.1 + 0.45 * (1 + math.cos(math.pi / 4)),  # 0.868198
        4: 0.55,  # progress 1/2: 0.1 + 0.45
        6: 0.1,  # progress 1
        9: 0.1,  # stays at min_lr
    }
    for step, lr in expected.items():
        assert lr_at(step, cos) == pytest.approx(lr, abs=1e-12), step
    const = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_at(s, const) for s in (0, 1, 3, 100)] == [0.25, 0.5, 1.0, 1.0]


def test_state_dict_resumes_bitwise():
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(3, 2, generator=gen).bfloat16()
    grads = [torch.randn(3, 2, generator=gen) for _ in range(3)]
    config = OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=1, total_steps=4)
    a = MasterAdamW([torch.nn.Parameter(w0.clone())], config)
    step_with(a, [grads[0]])
    step_with(a, [grads[1]])
    buffer = io.BytesIO()  # a checkpoint: state_dict holds references, as torch's does
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    b = MasterAdamW([torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))], config)
    b.load_state_dict(saved)
    assert torch.equal(b.params[0], a.params[0]) and b.num_updates == 2
    step_with(a, [grads[2]])
    step_with(b, [grads[2]])
    assert torch.equal(b.masters[0], a.masters[0]) and torch.equal(b.params[0], a.params[0])
    with pytest.raises(ValueError, match=r"master 0: saved torch.float32 \(3, 2\), expected"):
        MasterAdamW([param([1.0])], config).load_state_dict(saved)


@pytest.mark.parametrize(
    "key, value",
    [
        ("lr", 0.0),
        ("min_lr", 2e-6),  # > lr
        ("beta2", 1.0),
        ("eps", -1.0),
        ("weight_decay", float("nan")),
        ("max_grad_norm", 0.0),
        ("schedule", "linear"),
        ("warmup_steps", -1),
        ("total_steps", 0),
    ],
)
def test_config_rejects_naming_key_and_value(key, value):
    with pytest.raises(ValueError, match=rf"optim\.{key} .*got {value!r}"):
        OptimConfig(**{key: value})


def test_cosine_needs_total_steps_after_warmup():
    with pytest.raises(ValueError, match=r"optim\.total_steps .*warmup_steps \(5\).*got 5"):
        OptimConfig(schedule="cosine", warmup_steps=5, total_steps=5)


# --- micro-batch invariance of loss + optimizer ------------------------------------------------

LENGTHS = (3, 1, 4, 2, 5, 3)  # trained tokens of six completions packed into one stream
SPLITS = {1: [(0, 6)], 2: [(0, 3), (3, 6)], 3: [(0, 2), (2, 3), (3, 6)]}  # completion ranges


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_same_batch_in_1_2_3_micro_batches(aggregation):
    gen = torch.Generator().manual_seed(0)
    vocab, dim = 8, 4
    emb0, head0 = torch.randn(vocab, dim, generator=gen), torch.randn(dim, vocab, generator=gen)
    num_tokens, num_seqs = sum(LENGTHS), len(LENGTHS)
    seq_N = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(LENGTHS))
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    inputs_N = torch.randint(vocab, (num_tokens,), generator=gen)
    targets_N = torch.randint(vocab, (num_tokens,), generator=gen)
    adv_N = torch.randn(num_seqs, generator=gen)[seq_N]
    rollout_N = -torch.rand(num_tokens, generator=gen) * 3
    grpo = GrpoConfig(aggregation=aggregation, correction="tis", tis_cap=1.5)
    # max_grad_norm small enough that clipping acts: it must see the global gradient.
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)

    def run(ranges):
        emb, head = torch.nn.Parameter(emb0.clone()), torch.nn.Parameter(head0.clone())
        opt = MasterAdamW([emb, head], optim)
        for s0, s1 in ranges:
            a, b = starts[s0], starts[s1]
            logits = emb[inputs_N[a:b]] @ head
            logp_N = logits.log_softmax(-1).gather(1, targets_N[a:b, None]).squeeze(1)
            loss, _ = grpo_loss(
                logp_N, logp_rollout_N=rollout_N[a:b], advantages_N=adv_N[a:b],
                seq_index_N=seq_N[a:b] - s0, num_seqs=s1 - s0, config=grpo,
                total_tokens=num_tokens, total_seqs=num_seqs,
            )  # fmt: skip
            loss.backward()
            opt.accumulate()
        grads = [m.grad.clone() for m in opt.masters]
        norm = opt.step()["grad_norm"]
        return grads, norm, [emb.detach(), head.detach()]

    whole_grads, whole_norm, whole_params = run(SPLITS[1])
    assert whole_norm > optim.max_grad_norm
    for k in (2, 3):
        grads, norm, params = run(SPLITS[k])
        # The same FP32 terms summed in another grouping: a few ulps of gradients of size ~0.1.
        for g, ref in zip(grads, whole_grads, strict=True):
            torch.testing.assert_close(g, ref, rtol=0, atol=1e-7)
        assert norm == pytest.approx(whole_norm, rel=1e-6)
        # One update of size <= lr: the few-ulp gradient gap moves weights by << 1e-6.
        for p, ref in zip(params, whole_params, strict=True):
            torch.testing.assert_close(p, ref, rtol=0, atol=1e-6)
