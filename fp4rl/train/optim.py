"""The optimizer step of a model with BF16 parameters: FP32 master weights, FP32 AdamW moments.

Owns the master copies, gradient accumulation in FP32, clipping by global norm, the learning
rate schedule and the copy back into the model's parameters. Does not own the loss, nor how a
batch is split into micro-batches (``grpo_loss`` takes the whole batch's normalizers so that
the summed micro-batch gradients do not depend on the split).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from fp4rl import checks

Schedule = Literal["constant", "cosine"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # where the cosine ends
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0  # decoupled; applies to matrices only, never to norms or biases
    max_grad_norm: float | None = 1.0  # None: no clipping (the norm is still reported)
    # Steps of the schedule are optimizer steps: a run of run.steps rollouts takes
    # run.steps * grpo.mini_batches of them.
    schedule: Schedule = "constant"
    warmup_steps: int = 0  # linear warm-up, for either schedule
    total_steps: int | None = None  # "cosine" reaches min_lr at this step

    def __post_init__(self) -> None:
        checks.number("optim.lr", self.lr, "> 0", lambda v: v > 0)
        checks.number(
            "optim.min_lr", self.min_lr, f"in [0, lr={self.lr}]", lambda v: 0 <= v <= self.lr
        )
        checks.number("optim.beta1", self.beta1, "in [0, 1)", lambda v: 0 <= v < 1)
        checks.number("optim.beta2", self.beta2, "in [0, 1)", lambda v: 0 <= v < 1)
        checks.number("optim.eps", self.eps, "> 0", lambda v: v > 0)
        checks.number("optim.weight_decay", self.weight_decay, ">= 0", lambda v: v >= 0)
        if self.max_grad_norm is not None:
            checks.number(
                "optim.max_grad_norm", self.max_grad_norm, "> 0 (or None)", lambda v: v > 0
            )
        checks.choice("optim.schedule", self.schedule, get_args(Schedule))
        w = self.warmup_steps
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"optim.warmup_steps must be an int >= 0, got {w!r}")
        n = self.total_steps
        bad_n = n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1)
        if bad_n or (self.schedule == "cosine" and (n is None or n <= w)):
            raise ValueError(
                f"optim.total_steps must be None or an int >= 1, and an int > warmup_steps "
                f"({w}) for the cosine schedule, got {n!r}"
            )


def lr_at(step: int, config: OptimConfig) -> float:
    """The learning rate of update ``step`` (0 for the first update).

    Warm-up gives ``lr * (step + 1) / warmup_steps`` so the first update is not wasted at 0;
    the cosine then falls from ``lr`` at ``step == warmup_steps`` to ``min_lr`` at
    ``total_steps`` and stays there.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    progress = min(1.0, (step - config.warmup_steps) / (config.total_steps - config.warmup_steps))
    return config.min_lr + (config.lr - config.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw(masters: list[torch.Tensor], config: OptimConfig) -> torch.optim.AdamW:
    """torch's AdamW over FP32 ``masters``: decay for matrices only, the first update's lr."""
    decay = [m for m in masters if m.ndim >= 2]
    no_decay = [m for m in masters if m.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=lr_at(0, config),
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        # The fused kernel is one launch for all tensors on CUDA; elsewhere foreach.
        fused=all(m.is_cuda for m in masters) or None,
    )


class MasterAdamW:
    """AdamW over FP32 masters of the given parameters (BF16, or any float dtype).

    Per micro-batch: ``loss.backward()`` then ``accumulate()``, which adds each parameter's
    gradient into its master's FP32 gradient and frees it, so the sum over micro-batches is
    taken in FP32 rather than by autograd in BF16. ``step()`` accumulates whatever is left,
    clips, updates the masters, rounds them back into the parameters (round to nearest even,
    what ``copy_`` does) and zeroes every gradient. A non-finite gradient norm skips the update
    (reported as ``skipped``; the schedule does not advance) instead of writing NaN weights.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], config: OptimConfig) -> None:
        self.config = config
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MasterAdamW got no parameters that require grad")
        with torch.no_grad():
            self.masters = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.optimizer = adamw(self.masters, config)
        self.num_updates = 0

    @torch.no_grad()
    def accumulate(self) -> None:
        """Move every parameter's ``.grad`` into its master's FP32 gradient."""
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.to(torch.float32)
            else:
                m.grad.add_(p.grad)  # upcasts the BF16 operand, sums in FP32
            p.grad = None

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """One update; returns ``lr``, the pre-clip ``grad_norm`` and ``skipped`` (0 or 1)."""
        self.accumulate()
        with_grad = [m for m in self.masters if m.grad is not None]
        max_norm = self.config.max_grad_norm or math.inf
        grad_norm = self.clip(with_grad, max_norm)
        lr = lr_at(self.num_updates, self.config)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            # A master without a gradient (its parameter unused in this batch) is left alone,
            # moments included, as torch.optim.AdamW does.
            self.optimizer.step()
            self.write_back()
            self.num_updates += 1
        for m in self.masters:
            m.grad = None
        return {"lr": lr, "grad_norm": grad_norm, "skipped": float(skipped)}

    def clip(self, grads: list[torch.Tensor], max_norm: float) -> float:
        """Scale ``grads`` to a global norm of at most ``max_norm``; the norm before."""
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True))

    def write_back(self) -> None:
        """Round the masters into the parameters (round to nearest even, what ``copy_`` does)."""
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)

    def named_state(self, names: list[str]) -> dict:
        """The state by parameter name (``names[i]`` is ``self.params[i]``'s): ``num_updates``
        and, per name, ``master``, ``exp_avg``, ``exp_avg_sq`` and ``step`` (zero moments and
        step 0 for a master never updated: what AdamW starts from). A layout that does not
        depend on how the parameters are ordered or split, so another process count reads it.
        """
        if len(names) != len(self.masters):
            raise ValueError(f"{len(names)} names for {len(self.masters)} parameters")
        tensors = {}
        for name, m in zip(names, self.masters, strict=True):
            state = self.optimizer.state.get(m) or {}
            zero = torch.zeros_like(m)
            tensors[name] = {
                "master": m,
                "exp_avg": state.get("exp_avg", zero),
                "exp_avg_sq": state.get("exp_avg_sq", zero),
                "step": state.get("step", torch.zeros((), dtype=torch.float32)).detach().cpu(),
            }
        return {"num_updates": self.num_updates, "params": tensors}

    @torch.no_grad()
    def load_named_state(self, names: list[str], state: dict) -> None:
        """Restore what `named_state` gave (tensors of this optimizer's shapes and layout),
        and round the masters into the parameters."""
        params = state["params"]
        missing = [n for n in names if n not in params]
        if missing or len(params) != len(names):
            raise ValueError(
                f"saved state names {len(params)} parameters, this optimizer {len(names)}; "
                f"missing: {missing[:5]}"
            )
        by_master = {id(m): n for n, m in zip(names, self.masters, strict=True)}
        torch_state = self.optimizer.state_dict()  # param_groups: the masters' indices
        masters = [m for g in self.optimizer.param_groups for m in g["params"]]
        torch_state["state"] = {}
        for index, m in enumerate(masters):
            saved = params[by_master[id(m)]]
            m.copy_(saved["master"])
            torch_state["state"][index] = {
                "step": saved["step"].reshape(()).float(),
                "exp_avg": saved["exp_avg"],
                "exp_avg_sq": saved["exp_avg_sq"],
            }
        self.optimizer.load_state_dict(torch_state)
        self.write_back()
        self.num_updates = int(state["num_updates"])

    def state_dict(self) -> dict:
        """Masters, moments and step count, by reference (like torch's): save before stepping."""
        return {
            "num_updates": self.num_updates,
            "masters": list(self.masters),  # references, like torch's own state_dict
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore masters, moments and the step count, and round the masters into the params."""
        masters = state["masters"]
        if len(masters) != len(self.masters):
            raise ValueError(
                f"state has {len(masters)} masters, this optimizer {len(self.masters)}"
            )
        for i, (m, saved) in enumerate(zip(self.masters, masters, strict=True)):
            if saved.shape != m.shape or saved.dtype != torch.float32:
                raise ValueError(
                    f"master {i}: saved {saved.dtype} {tuple(saved.shape)}, "
                    f"expected torch.float32 {tuple(m.shape)}"
                )
        for p, m, saved in zip(self.params, self.masters, masters, strict=True):
            m.copy_(saved)
            p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_updates = int(state["num_updates"])
