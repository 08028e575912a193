"""Grouped-query attention and the backend protocol that owns the KV.

The `Attention` module projects, normalizes (Qwen3 per-head q/k RMSNorm) and rotates; where K
and V live and how the context is gathered belongs to an *attention backend*, an argument of the
forward: `CausalAttention` (SDPA over packed sequences, in the model dtype or FP32) or
`EngineOrderAttention` (the rollout engine's arithmetic row by row) here for the trainer's
full-sequence forward, the paged cache in `fp4rl.rollout` for generation. `attend_fp32`, the
rollout's attention arithmetic, lives here so that both sides can run it. The layer owns its KV
format, built from the precision plan (`Bf16KV`, or `Nvfp4KV` with the layer's K and V
`Fp4Site`s), and hands it to the backend with the new K/V (`NewKV`): the trainer attends over
the sites' values, the cache stores the rows the sites round to nearest (quantized straight
into its pages), so an NVFP4 KV entry has the same bits on both sides and no caller states the
KV format a second time.

Legend: T tokens (flattened over sequences), H hidden, Hq/Hkv query/kv heads, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fp4rl.fp4 import NVFP4Tensor
from fp4rl.model.layers import RMSNorm, RopeTables, normed_rope, project
from fp4rl.model.sites import Capture, Fp4Site
from fp4rl.records import GuidanceMap

KVEntry = torch.Tensor | NVFP4Tensor  # [T, Hkv, D] as held by a cache of the layer's format


class Bf16KV:
    """A layer whose K/V stay in the model dtype: attended over and cached as they are."""

    def values(self, k_TKD, v_TKD, guidance, capture) -> tuple[torch.Tensor, torch.Tensor]:
        return k_TKD, v_TKD

    def packed(self, k_TKD, v_TKD, guidance, capture) -> tuple[KVEntry, KVEntry]:
        return k_TKD, v_TKD

    def store(self, kv: NewKV, cache, layer: int, slots_T: torch.Tensor) -> None:
        cache.write(layer, slots_T, kv.k_TKD, kv.v_TKD)


class Nvfp4KV:
    """A layer whose K (after RoPE) and V pass through NVFP4 sites, one global scale per
    token-head: the trainer attends over the sites' values, a cache stores their `NVFP4Tensor`s
    and dequantizes them on read, which gives the same bits (quantization is per row)."""

    def __init__(self, layer: int, guided_sites: tuple[str, ...]) -> None:
        self.k_site = Fp4Site(layer, "k", "k" in guided_sites)
        self.v_site = Fp4Site(layer, "v", "v" in guided_sites)

    def values(self, k_TKD, v_TKD, guidance, capture) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_site(k_TKD, guidance, capture), self.v_site(v_TKD, guidance, capture)

    def packed(self, k_TKD, v_TKD, guidance, capture) -> tuple[KVEntry, KVEntry]:
        return (
            self.k_site.quantize(k_TKD, guidance, capture),
            self.v_site.quantize(v_TKD, guidance, capture),
        )

    def store(self, kv: NewKV, cache, layer: int, slots_T: torch.Tensor) -> None:
        """K and V quantized per token-head straight into the cache's pages (`KVCache.write`:
        `ops.quantize_into_pair`, one launch on the GPU), bitwise the rows `packed()` gives; a
        site whose record the capture keeps gets it from the same write
        (`Fp4Site.on_the_way`), or makes it itself where its capture keeps values too
        (`Fp4Site.quantize`). The pages keep rows rounded to nearest (each with its amax in
        place of its global scale), so a site that would follow guidance here is refused rather
        than stored otherwise."""
        sites = ((self.k_site, kv.k_TKD), (self.v_site, kv.v_TKD))
        for site, _ in sites:
            if site.follows(kv.guidance):
                raise ValueError(
                    f"layers.{site.layer} site '{site.name}' follows guidance, but a paged NVFP4 "
                    "KV cache keeps rows rounded to nearest"
                )
        forms = [site.on_the_way(kv.guidance, kv.capture) for site, _ in sites]
        for (site, x), form in zip(sites, forms, strict=True):
            if form is None:
                site.quantize(x, kv.guidance, kv.capture)  # its record, with its values
        # One capture keeps one form: the write makes both records if either site keeps one.
        form = next((f for f in forms if f), None)
        records = cache.write(layer, slots_T, kv.k_TKD.detach(), kv.v_TKD.detach(), record=form)
        for (site, _), wanted, record in zip(sites, forms, records, strict=True):
            if wanted:
                site.keep(kv.capture, record)


@dataclass(frozen=True, slots=True)
class NewKV:
    """One layer's K/V of this forward with the layer's KV format and the forward's guidance
    and capture: a backend attends over `values()` or stores `packed()` (`store` writes them
    into a paged cache), never both."""

    k_TKD: torch.Tensor
    v_TKD: torch.Tensor
    format: Bf16KV | Nvfp4KV
    guidance: GuidanceMap | None = None
    capture: Capture | None = None

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.format.values(self.k_TKD, self.v_TKD, self.guidance, self.capture)

    def packed(self) -> tuple[KVEntry, KVEntry]:
        return self.format.packed(self.k_TKD, self.v_TKD, self.guidance, self.capture)

    def store(self, cache, layer: int, slots_T: torch.Tensor) -> None:
        """Write `packed()`'s entries into a paged ``cache`` (`fp4rl.rollout.KVCache.write`) at
        ``slots_T``, recording what `packed()` records."""
        self.format.store(self, cache, layer, slots_T)


class AttentionBackend(Protocol):
    positions: torch.Tensor  # long [T]: each token's position within its own sequence

    def attend(self, layer: int, q_THD: torch.Tensor, kv: NewKV) -> torch.Tensor:
        """Take this step's K/V for ``layer`` and return causal attention ``[T, Hq, D]``."""
        ...


def attend_fp32(
    q_BQHD: torch.Tensor,
    k_BCKD: torch.Tensor,
    v_BCKD: torch.Tensor,
    q_positions_BQ: torch.Tensor,
    context_B: torch.Tensor,
) -> torch.Tensor:
    """Causal GQA over gathered context (slot c holds position c); FP32 ``[B, Q, Hq, D]``.

    The rollout's attention off the GPU (`fp4rl.rollout.attention`: prefills and decodes) and
    the spec of its paged kernels on the GPU; the trainer's engine-order backend
    (`EngineOrderAttention`) calls it on the shapes the engine does. Its FP32 sums, hence its
    low bits, depend on the shapes: the padded context length ``C`` included."""
    B, Q, Hq, D = q_BQHD.shape
    C, K = k_BCKD.shape[1], k_BCKD.shape[2]
    q = q_BQHD.float().view(B, Q, K, Hq // K, D)
    scores_BKGQC = torch.einsum("bqkgd,bckd->bkgqc", q, k_BCKD.float()) * (1.0 / math.sqrt(D))
    c = torch.arange(C, device=q.device)
    visible_BQC = (c <= q_positions_BQ[:, :, None]) & (c < context_B[:, None, None])
    scores_BKGQC = scores_BKGQC.masked_fill(~visible_BQC[:, None, None], float("-inf"))
    p = torch.softmax(scores_BKGQC, dim=-1)
    return torch.einsum("bkgqc,bckd->bqkgd", p, v_BCKD.float()).reshape(B, Q, Hq, D)


class Attention(nn.Module):
    def __init__(
        self, config, layer: int, *, kv_format: str = "bf16", guided_sites: tuple[str, ...] = ()
    ) -> None:
        """``kv_format`` ("bf16" | "nvfp4", from the precision plan) fixes the layer's K/V
        sites; ``guided_sites``: which sites follow the rollout's guidance (the plan's)."""
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        hd, bias = config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        if kv_format == "nvfp4":
            self.kv_format: Bf16KV | Nvfp4KV = Nvfp4KV(layer, guided_sites)
        elif kv_format == "bf16":
            self.kv_format = Bf16KV()
        else:
            raise ValueError(
                f"layers.{layer}: kv_format must be 'bf16' or 'nvfp4', got {kv_format!r}"
            )

    def forward(
        self,
        x_TH: torch.Tensor,
        backend: AttentionBackend,
        rope: RopeTables,
        guidance: GuidanceMap | None = None,
        capture: Capture | None = None,
    ) -> torch.Tensor:
        """``rope``: the forward's RoPE tables of ``backend.positions``, built once by the
        model's forward and shared by its layers."""
        T = x_TH.shape[0]
        made = (rope.head_dim, rope.theta, rope.cos.dtype)
        if made != (self.head_dim, self.rope_theta, x_TH.dtype):
            raise ValueError(
                f"layers.{self.layer}: RoPE tables of (head_dim, theta, dtype) {made}; the "
                f"layer needs {(self.head_dim, self.rope_theta, x_TH.dtype)}"
            )
        cos, signed_sin = rope.cos, rope.signed_sin
        q, k, v = project(x_TH, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        k = normed_rope(k, self.k_norm, cos, signed_sin)
        kv = NewKV(k, v, self.kv_format, guidance, capture)
        o = backend.attend(self.layer, normed_rope(q, self.q_norm, cos, signed_sin), kv)
        # o by the projection kernel too where it beats cuBLAS: a few rows (`fp4rl.ops.project`).
        return project(o.reshape(T, self.num_heads * self.head_dim), self.o_proj)[0]


class CausalAttention:
    """Trainer backend: causal attention within each of several packed sequences.

    ``seq_lens`` gives the lengths of the sequences concatenated in the token stream. K/V are
    the layer's site values (`NewKV.values`: NVFP4 fake quantization, guided and captured like
    any other site, in the plan's NVFP4-KV layers). Nothing is cached: each call sees whole
    sequences. ``fp32``: attend in FP32 and round the output to the model dtype once, the
    precision the rollout's attention has (`attend_fp32`); otherwise in the model dtype, where
    SDPA's BF16 internals differ from the rollout in about a quarter of the output values.
    """

    def __init__(
        self, seq_lens: Sequence[int], *, fp32: bool = False, device: torch.device | str = "cpu"
    ) -> None:
        lens = _check_lens("seq_lens", seq_lens)
        self.seq_lens, self.fp32 = lens, fp32
        self.positions = torch.cat([torch.arange(n, device=device) for n in lens])
        # Right-padded [B, S] layout: padding sits after each sequence's last token, so under
        # a causal mask no real token attends to it.
        S = max(lens)
        self._valid_BS = (
            torch.arange(S, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        )

    def attend(self, layer, q_THD, kv: NewKV):
        k_TKD, v_TKD = kv.values()
        dtype = torch.float32 if self.fp32 else q_THD.dtype
        q, k, v = (self._pad(t.to(dtype)).transpose(1, 2) for t in (q_THD, k_TKD, v_TKD))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B,h,S,D]
        return o.transpose(1, 2)[self._valid_BS].to(q_THD.dtype)

    def _pad(self, x_THD: torch.Tensor) -> torch.Tensor:
        B, S = self._valid_BS.shape
        out = x_THD.new_zeros(B, S, *x_THD.shape[1:])
        out[self._valid_BS] = x_THD
        return out


class EngineOrderAttention:
    """Trainer backend that attends the way the rollout engine did, row by row (CPU only).

    The engine prefills each prompt as one segment, alone (`attend_fp32` over the prompt), then
    feeds each completion token in a decode step: one query over its cached context. Here each
    sequence's prompt rows run `attend_fp32` over that prompt alone -- the engine's call on the
    engine's shapes, hence its bits -- and each completion row runs it as one query over its
    own context, the rows of equal context batched (the engine batches its decodes too). K and
    V are the layer's site values (`NewKV.values`), which are bitwise what the engine's cache
    returns. Gradients flow through `attend_fp32` like through any PyTorch op.

    What it cannot know: the engine pads a decode step's contexts to the step's longest, and
    the low bits of `attend_fp32`'s FP32 sums depend on that padded length, so a completion row
    matches the engine bitwise only where its step's padding falls in the same class as its
    own context (docs/alignment.md measures how often); and a sequence the engine preempted
    was prefilled again over more than its prompt.

    ``prompt_lens[b]``: the tokens the engine prefilled for sequence b, from 1 to
    ``seq_lens[b]``; the rows after them are decode rows. ``prefilled_by[b]`` (default: b):
    the sequence whose prefill b shares, as the engine's samples of one prompt share their
    group leader's -- an earlier sequence with the same prompt, prefilled by itself. Its
    attention output stands for b's prompt rows, so each prompt is attended once: the values
    are the same and so is the gradient reaching the parameters (b's rows are the leader's).
    """

    def __init__(
        self,
        seq_lens: Sequence[int],
        prompt_lens: Sequence[int],
        *,
        prefilled_by: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        lens = _check_lens("seq_lens", seq_lens)
        prompts = _check_lens("prompt_lens", prompt_lens)
        if len(prompts) != len(lens) or any(p > n for p, n in zip(prompts, lens, strict=True)):
            raise ValueError(
                f"prompt_lens {prompts} must give one length per sequence, each at most its "
                f"sequence's length (seq_lens {lens})"
            )
        leader = list(range(len(lens))) if prefilled_by is None else list(prefilled_by)
        _check_leaders(leader, prompts)
        self.positions = torch.cat([torch.arange(n, device=device) for n in lens])
        starts = [0, *accumulate(lens)][:-1]
        # Where each row's output comes from in the concatenated results of `attend`.
        source_T = [0] * len(self.positions)
        done, first = 0, {}
        self._prefills = []  # one per leader: its prompt's rows [1, P]
        for b, (s, p) in enumerate(zip(starts, prompts, strict=True)):
            if leader[b] == b:
                self._prefills.append(torch.arange(s, s + p, device=device)[None])
                first[b], done = done, done + p
            source_T[s : s + p] = range(first[leader[b]], first[leader[b]] + p)
        # Decode rows grouped by context length C: query rows [n] and context rows [n, C]. A
        # context that one row alone has is attended twice in one call: `attend_fp32` orders
        # its FP32 sums differently for one sequence than for several, as the engine has.
        by_context: dict[int, list[int]] = {}
        for s, p, n in zip(starts, prompts, lens, strict=True):
            for pos in range(p, n):
                by_context.setdefault(pos + 1, []).append(s)
        self._decodes = []
        for C, firsts in sorted(by_context.items()):
            firsts_n = torch.tensor(firsts * (2 if len(firsts) == 1 else 1), device=device)
            context_nC = firsts_n[:, None] + torch.arange(C, device=device)
            self._decodes.append((firsts_n + (C - 1), context_nC, len(firsts)))
            for i, s in enumerate(firsts):
                source_T[s + C - 1] = done + i
            done += len(firsts)
        self._source_T = torch.tensor(source_T, device=device)

    def attend(self, layer, q_THD, kv: NewKV):
        if q_THD.is_cuda:
            raise ValueError(
                "EngineOrderAttention reproduces the engine's CPU attention; on CUDA the "
                "engine decodes through the paged kernel, whose arithmetic it does not follow"
            )
        k_TKD, v_TKD = kv.values()
        pieces = []
        for rows_1P in self._prefills:
            P = rows_1P.shape[1]
            positions_1P = rows_1P - rows_1P[:, :1]
            context_1 = torch.tensor([P], device=q_THD.device)
            o = attend_fp32(q_THD[rows_1P], k_TKD[rows_1P], v_TKD[rows_1P], positions_1P, context_1)
            pieces.append(o[0].to(q_THD.dtype))
        for rows_n, context_nC, num in self._decodes:
            n, C = context_nC.shape
            last_n1 = torch.full((n, 1), C - 1, device=q_THD.device)
            context_n = torch.full((n,), C, device=q_THD.device)
            q_n1HD = q_THD[rows_n][:, None]
            o = attend_fp32(q_n1HD, k_TKD[context_nC], v_TKD[context_nC], last_n1, context_n)
            pieces.append(o[:num, 0].to(q_THD.dtype))
        return torch.cat(pieces)[self._source_T]


def _check_leaders(leader: list[int], prompts: list[int]) -> None:
    if len(leader) != len(prompts) or any(
        not 0 <= r <= b or leader[r] != r or prompts[r] != prompts[b] for b, r in enumerate(leader)
    ):
        raise ValueError(
            f"prefilled_by {leader} must name, per sequence, itself or an earlier sequence that "
            f"prefilled itself, with a prompt of the same length (prompt_lens {prompts})"
        )


def _check_lens(name: str, lens: Sequence[int]) -> list[int]:
    out = list(lens)
    if not out or not all(isinstance(n, int) and not isinstance(n, bool) for n in out):
        raise ValueError(f"{name} must be a non-empty sequence of ints, got {lens!r}")
    if min(out) < 1:
        raise ValueError(f"{name} must be positive lengths, got {out}")
    return out
