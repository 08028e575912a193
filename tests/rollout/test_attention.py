"""PagedAttention against dense causal attention, BF16 and NVFP4 pages, over several steps.

Exact claims: cached K/V read back bitwise equal to what was written (BF16 pages) or to the
trainer's fake quantization ``dequantize(quantize(x, scaling="row"), dtype)`` (NVFP4 pages:
the cache stores what the layer's K/V sites produce), and the NVFP4 records the sites hand to
the capture are that quantization. Attention outputs are
compared with `F.scaled_dot_product_attention` over the same (fake-quantized) K/V within the
stated tolerance: FP32 inputs to 2e-6 (only the summation order differs), BF16 inputs to one
BF16 rounding of the output.
"""

import pytest
import torch
import torch.nn.functional as F

from fp4rl.fp4.reference import rows_tensor
from fp4rl.model.attention import Bf16KV, NewKV, Nvfp4KV
from fp4rl.model.precision import SITES
from fp4rl.model.sites import SiteRecords
from fp4rl.ops import dequantize, quantize
from fp4rl.rollout.attention import (
    STORE_AT_EXIT_MIN_DECODES,
    AttentionMetadata,
    PagedAttention,
    Segment,
)
from fp4rl.rollout.kv_cache import KVCache, KVCacheSpec

HQ, HKV, D, BLOCK = 4, 2, 32, 4


def fake_quant(x):
    return dequantize(quantize(x, scaling="row"), x.dtype)


def dense_reference(q_QHD, k_CKD, v_CKD, q_positions):
    """Causal SDPA in FP32 for the queries at ``q_positions`` over context ``[0, C)``."""
    q, k, v = (t.float().transpose(0, 1)[None] for t in (q_QHD, k_CKD, v_CKD))
    mask = torch.arange(k_CKD.shape[0])[None, :] <= q_positions[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
def test_paged_attention_matches_dense_over_steps(dtype, atol):
    g = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(layer_formats=("bf16", "nvfp4"), num_kv_heads=HKV, head_dim=D, dtype=dtype)
    cache = KVCache(spec, num_blocks=32, block_size=BLOCK, device="cpu")
    # Block tables deliberately out of order and interleaved between sequences.
    order = torch.randperm(32, generator=g).tolist()
    tables = {"a": order[0:5], "b": order[5:10], "c": order[10:15]}
    full_len = {"a": 9, "b": 14, "c": 11}
    kv = {  # per sequence, per layer: all positions' K and V
        s: [
            (
                torch.randn(n, HKV, D, generator=g).to(dtype),
                torch.randn(n, HKV, D, generator=g).to(dtype),
            )
            for _ in range(2)
        ]
        for s, n in full_len.items()
    }
    # (sequence, start, num_new) per step: prefills, decodes, and a multi-token extension.
    steps = [
        [("a", 0, 7), ("b", 0, 12)],
        [("c", 0, 5), ("a", 7, 1), ("b", 12, 1)],
        [("a", 8, 1), ("c", 5, 6), ("b", 13, 1)],
    ]
    for step in steps:
        segments = [Segment(tables[s], start, n) for s, start, n in step]
        meta = AttentionMetadata.build(segments, BLOCK, "cpu")
        rec = SiteRecords()
        backend = PagedAttention(cache, meta)
        formats = (Bf16KV(), Nvfp4KV(1, SITES))
        expected_positions = torch.cat([torch.arange(st, st + n) for _, st, n in step])
        assert torch.equal(backend.positions, expected_positions)
        for layer in range(2):
            q = torch.randn(meta.positions_T.numel(), HQ, D, generator=g).to(dtype)
            k = torch.cat([kv[s][layer][0][st : st + n] for s, st, n in step])
            v = torch.cat([kv[s][layer][1][st : st + n] for s, st, n in step])
            o = backend.attend(layer, q, NewKV(k, v, formats[layer], capture=rec))
            assert o.dtype == dtype and o.shape == q.shape
            row = 0
            for s, st, n in step:
                k_all, v_all = kv[s][layer][0][: st + n], kv[s][layer][1][: st + n]
                if layer == 1:
                    k_all, v_all = fake_quant(k_all), fake_quant(v_all)
                ref = dense_reference(q[row : row + n], k_all, v_all, torch.arange(st, st + n))
                torch.testing.assert_close(o[row : row + n].float(), ref, rtol=0, atol=atol)
                row += n
        # Only the NVFP4 layer records, and it records exactly the trainer's quantization.
        assert list(rec.sites) == [(1, "k"), (1, "v")]
        assert rec.sites[(1, "k")].equal(quantize(k, scaling="row"))
        assert rec.sites[(1, "v")].equal(quantize(v, scaling="row"))

    # Every sequence's cache, read back: BF16 exact, NVFP4 bitwise the fake-quantized values.
    for s, n in full_len.items():
        slots = torch.tensor([tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        for layer in range(2):
            k_read, v_read = cache.read(layer, slots, dtype)
            k_all, v_all = kv[s][layer]
            if layer == 1:
                k_all, v_all = fake_quant(k_all), fake_quant(v_all)
            assert torch.equal(k_read, k_all) and torch.equal(v_read, v_all)


def test_copy_blocks_copies_every_layer_and_member():
    spec = KVCacheSpec(
        layer_formats=("bf16", "nvfp4"), num_kv_heads=1, head_dim=16, dtype=torch.float32
    )
    cache = KVCache(spec, num_blocks=4, block_size=2, device="cpu")
    x = torch.randn(2, 1, 16)
    slots = torch.tensor([2, 3])  # block 1
    cache.write(0, slots, x, -x)
    cache.write(1, slots, x, -x)
    cache.copy_blocks([(1, 3)])
    for layer in range(2):
        a = cache.read(layer, slots, torch.float32)
        b = cache.read(layer, slots + 4, torch.float32)
        assert all(torch.equal(u, w) for u, w in zip(a, b, strict=True))


def test_metadata_rejects_a_table_too_short():
    with pytest.raises(ValueError, match="does not fit"):
        AttentionMetadata.build([Segment([0], 3, 2)], 4, "cpu")


def test_cache_refuses_entries_it_cannot_store_exactly():
    """K/V values in another dtype than the cache's (an NVFP4 layer keeps each row's amax in
    it) or quantized entries are refused, naming the layer."""
    spec = KVCacheSpec(
        layer_formats=("bf16", "nvfp4"), num_kv_heads=1, head_dim=16, dtype=torch.bfloat16
    )
    cache = KVCache(spec, num_blocks=4, block_size=2, device="cpu")
    x, slots = torch.randn(2, 1, 16), torch.tensor([0, 1])
    for layer in (0, 1):
        with pytest.raises(TypeError, match=rf"layers.{layer}: .* torch.bfloat16; k_TKD is "
                                            r"torch.float32"):  # fmt: skip
            cache.write(layer, slots, x, x.bfloat16())
    q = quantize(x, scaling="row")
    with pytest.raises(TypeError, match=r"layers.1: .*; v_TKD is NVFP4Tensor"):
        cache.write(1, slots, x.bfloat16(), q)


class _Keeps(SiteRecords):
    """Records only the K site."""

    def records(self, layer, site):
        return site == "k"


@pytest.mark.parametrize("capture", [None, _Keeps()], ids=["unrecorded", "k recorded"])
def test_nvfp4_sites_store_the_bits_of_quantize(monkeypatch, capture):
    """An NVFP4 layer's K/V go straight into the pages, K and V in one call, recorded or not;
    the pages hold the sites' nearest rows (each with its amax in place of its global scale),
    and a recorded site's record is its `NVFP4Tensor`."""
    from fp4rl import ops

    g = torch.Generator().manual_seed(3)
    spec = KVCacheSpec(layer_formats=("nvfp4",), num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16)
    cache = KVCache(spec, num_blocks=8, block_size=BLOCK, device="cpu")
    k, v = (torch.randn(6, HKV, D, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = torch.randperm(8 * BLOCK, generator=g)[:6]
    paired = []
    pair = ops.quantize_into_pair
    monkeypatch.setattr(
        ops, "quantize_into_pair", lambda kx, *a: paired.append((kx, a[1])) or pair(kx, *a)
    )
    NewKV(k, v, Nvfp4KV(0, SITES), capture=capture).store(cache, 0, slots)
    assert len(paired) == 1
    assert torch.equal(paired[0][0], k) and torch.equal(paired[0][1], v)
    for pages, x in zip(cache.pages(0), (k, v), strict=True):
        got = rows_tensor(pages.map(lambda m: m.flatten(0, 1)[slots]))
        assert got.equal(quantize(x, scaling="row"))
        assert torch.equal(pages.amax.flatten(0, 1)[slots], x.abs().amax(-1, keepdim=True))
    if capture is not None:
        assert list(capture.sites) == [(0, "k")] and capture.sites[(0, "k")].equal(
            quantize(k, scaling="row")
        )


@pytest.mark.parametrize("decodes", [1, 7, 8, 9])
def test_kv_store_lets_a_large_decode_attention_start_only_at_its_exit(decodes, monkeypatch):
    """From `STORE_AT_EXIT_MIN_DECODES` decodes the K/V store runs inside
    ``ops.early_dependents(device, False)``: in a graph captured with early dependents, the
    decode attention after it is placed only as it exits. Below, it stays early."""
    import contextlib

    from fp4rl import ops

    scopes, seen = [], []

    @contextlib.contextmanager
    def early_dependents(device, on=True):
        scopes.append(on)
        try:
            yield
        finally:
            scopes.pop()

    def store(self, kv, cache, layer, slots_T):
        seen.append(list(scopes))
        cache.write(layer, slots_T, kv.k_TKD, kv.v_TKD)

    monkeypatch.setattr(ops, "early_dependents", early_dependents)
    monkeypatch.setattr(Bf16KV, "store", store)
    spec = KVCacheSpec(layer_formats=("bf16",), num_kv_heads=HKV, head_dim=D, dtype=torch.float32)
    cache = KVCache(spec, num_blocks=decodes, block_size=BLOCK, device="cpu")
    segments = [Segment([b], 2, 1) for b in range(decodes)]  # one new token after two cached
    meta = AttentionMetadata.build(segments, BLOCK, "cpu")
    assert meta.decode_rows_B.shape[0] == decodes
    q, k, v = (
        torch.randn(decodes, HQ, D),
        torch.randn(decodes, HKV, D),
        torch.randn(decodes, HKV, D),
    )
    with early_dependents("cuda", True):  # as a graph's capture would
        PagedAttention(cache, meta).attend(0, q, NewKV(k, v, Bf16KV()))
    at_exit = decodes >= STORE_AT_EXIT_MIN_DECODES
    assert STORE_AT_EXIT_MIN_DECODES == 8
    assert seen == [[True, False] if at_exit else [True]]
