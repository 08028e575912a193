"""Grouped-query attention and the backend protocol that owns the KV.

The `Attention` module projects, normalizes (Qwen3 per-head q/k RMSNorm) and rotates; where K
and V live and how the context is gathered belongs to an *attention backend*, an argument of the
forward: `CausalAttention` here for the trainer's full-sequence forward, the paged cache in
`fp4rl.rollout` for generation. Both apply the layer's KV format with the same `Fp4Site`, so an
NVFP4 KV entry has the same bits on both sides.

Legend: T tokens (flattened over sequences), H hidden, Hq/Hkv query/kv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fp4rl.model.layers import RMSNorm, apply_rope, rope_cos_sin
from fp4rl.model.sites import Capture, Fp4Site, GuidanceMap


class AttentionBackend(Protocol):
    positions: torch.Tensor  # long [T]: each token's position within its own sequence

    def attend(
        self, layer: int, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor
    ) -> torch.Tensor:
        """Store this step's K/V for ``layer`` and return causal attention ``[T, Hq, D]``."""
        ...


class Attention(nn.Module):
    def __init__(self, config, layer: int) -> None:
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

    def forward(self, x_TH: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        T = x_TH.shape[0]
        q = self.q_norm(self.q_proj(x_TH).view(T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x_TH).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_TH).view(T, self.num_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(backend.positions, self.head_dim, self.rope_theta, x_TH.dtype)
        o = backend.attend(self.layer, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class CausalAttention:
    """Trainer backend: causal attention within each of several packed sequences.

    ``seq_lens`` gives the lengths of the sequences concatenated in the token stream. K/V of the
    layers listed in ``nvfp4_kv_layers`` pass through an NVFP4 `Fp4Site` per token-head, guided
    and captured like any other site. Nothing is cached: each call sees whole sequences.
    """

    def __init__(
        self,
        seq_lens: Sequence[int],
        *,
        device: torch.device | str = "cpu",
        nvfp4_kv_layers: Sequence[int] = (),
        guided: bool = True,
        guidance: GuidanceMap | None = None,
        capture: Capture | None = None,
    ) -> None:
        lens = [int(n) for n in seq_lens]
        if not lens or min(lens) < 1:
            raise ValueError(f"seq_lens must be positive lengths, got {lens}")
        self.seq_lens = lens
        self.positions = torch.cat([torch.arange(n, device=device) for n in lens])
        self._kv_sites = {
            layer: (Fp4Site(layer, "k", guided), Fp4Site(layer, "v", guided))
            for layer in nvfp4_kv_layers
        }
        self.guidance, self.capture = guidance, capture
        # Right-padded [B, S] layout: padding sits after each sequence's last token, so under
        # a causal mask no real token attends to it.
        S = max(lens)
        self._valid_BS = (
            torch.arange(S, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        )

    def attend(self, layer, q_THD, k_TKD, v_TKD):
        if layer in self._kv_sites:
            k_site, v_site = self._kv_sites[layer]
            k_TKD = k_site(k_TKD, self.guidance, self.capture)
            v_TKD = v_site(v_TKD, self.guidance, self.capture)
        q, k, v = (self._pad(t).transpose(1, 2) for t in (q_THD, k_TKD, v_TKD))  # [B, h, S, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2)[self._valid_BS]

    def _pad(self, x_THD: torch.Tensor) -> torch.Tensor:
        B, S = self._valid_BS.shape
        out = x_THD.new_zeros(B, S, *x_THD.shape[1:])
        out[self._valid_BS] = x_THD
        return out
