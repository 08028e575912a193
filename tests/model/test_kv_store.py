"""How an NVFP4-KV layer stores its new K and V rows in the paged cache (`Nvfp4KV.store`): both
go straight into the pages through one op (`ops.quantize_into_pair`: one launch on the GPU),
whether or not a capture records the sites (a recorded site's record comes from the same op,
full or compact as the capture keeps it). The pages keep rows rounded to nearest, so a site that
would follow guidance is refused."""

import pytest
import torch
from assertions import assert_bitwise
from tiny_models import DEVICES, packed_twin, qat_model, tiny_config, tiny_precision

from fp4rl import ops
from fp4rl.model.attention import NewKV, Nvfp4KV
from fp4rl.model.precision import SITES
from fp4rl.model.sites import SiteRecords
from fp4rl.rollout.attention import AttentionMetadata, PagedAttention, Segment
from fp4rl.rollout.kv_cache import KVCache, KVCacheSpec
from fp4rl.rollout.model_layout import ModelLayout


class Keeps(SiteRecords):
    """Records only the sites named."""

    def __init__(self, *sites: str) -> None:
        super().__init__()
        self.kept = sites

    def records(self, layer, site):
        return site in self.kept


@pytest.fixture
def pair_calls(monkeypatch):
    """The `ops.quantize_into_pair` calls (each still runs): the K values of each."""
    calls = []
    real = ops.quantize_into_pair

    def counted(k_TKD, *args):
        calls.append(k_TKD)
        return real(k_TKD, *args)

    monkeypatch.setattr(ops, "quantize_into_pair", counted)
    return calls


def steps():
    """A prefill beside a prefill, then decodes alone: block tables out of order."""
    tables = {"a": [5, 2, 7], "b": [0, 6, 3]}
    plan = [[("a", 0, 6), ("b", 0, 3)], [("a", 6, 1), ("b", 3, 1)], [("b", 4, 1)]]
    tokens = {"a": [3, 1, 4, 1, 5, 9, 2], "b": [6, 5, 3, 5, 8]}
    for step in plan:
        segments = [Segment(tables[s], start, n) for s, start, n in step]
        ids = [t for s, start, n in step for t in tokens[s][start : start + n]]
        yield segments, torch.tensor(ids)


def random_cache(spec: KVCacheSpec, device) -> KVCache:
    """A cache whose pages hold random bytes: a slot written by mistake, or left unwritten,
    shows."""
    cache = KVCache(spec, num_blocks=8, block_size=4, device=device)
    g = torch.Generator().manual_seed(0)
    for t in (t for layer in cache.layers for t in layer.tensors()):
        bytes_ = t.view(torch.uint8)
        bytes_.copy_(torch.randint(0, 256, bytes_.shape, dtype=torch.uint8, generator=g))
    return cache


def page_bytes(cache: KVCache) -> torch.Tensor:
    """Every page of every layer as bytes, on the CPU."""
    tensors = [t for layer in cache.layers for t in layer.tensors()]
    return torch.cat([t.flatten().view(torch.uint8).cpu() for t in tensors])


@pytest.mark.parametrize("device", DEVICES)
@torch.inference_mode()
def test_recorded_or_not_the_pages_are_filled_alike(device, pair_calls):
    """A packed model's forwards through the rollout backend (prefills, then decodes) leave
    every page bitwise the same whether a capture records the K sites or not, and the pair op
    is asked for once per NVFP4 layer per step either way."""
    precision = tiny_precision("nvfp4")  # layers 1 and 2 of 4 hold NVFP4 KV
    qat = qat_model(precision, config=tiny_config(head_dim=32), dtype=torch.bfloat16, device=device)
    model = packed_twin(qat, precision)
    spec = ModelLayout.of(model).kv
    nvfp4_layers = spec.layer_formats.count("nvfp4")
    assert 0 < nvfp4_layers < len(spec.layer_formats)
    caches = [random_cache(spec, device) for _ in range(2)]
    start = page_bytes(caches[0])
    for segments, tokens_T in steps():
        meta = AttentionMetadata.build(segments, 4, device)
        tokens_T = tokens_T.to(device)
        before = len(pair_calls)
        model.hidden_states(tokens_T, PagedAttention(caches[0], meta))
        assert len(pair_calls) == before + nvfp4_layers
        capture = Keeps("k")
        model.hidden_states(tokens_T, PagedAttention(caches[1], meta), capture=capture)
        assert len(pair_calls) == before + 2 * nvfp4_layers
        assert {key for key in capture.sites if key[1] == "k"} == {(1, "k"), (2, "k")}
    assert_bitwise(page_bytes(caches[0]), page_bytes(caches[1]), "pages")
    assert not torch.equal(page_bytes(caches[0]), start)  # the steps did write


@pytest.mark.parametrize(
    ("guided_sites", "guided", "kept", "refused"),
    [
        ((), False, None, None),
        (SITES, False, None, None),  # guided sites, but this forward follows no record
        ((), True, None, None),  # a record is given, but the policy guides neither site
        ((), False, (), None),  # a capture that keeps neither site
        ((), False, ("expert_input",), None),
        ((), False, ("k",), None),
        ((), False, ("v",), None),
        (("v",), True, None, "v"),
        (("k", "v"), True, (), "k"),
    ],
)
def test_the_pages_hold_the_nearest_rows_and_guided_sites_are_refused(
    pair_calls, guided_sites, guided, kept, refused
):
    """Whatever the capture keeps, the pages hold what writing the K/V values stores (one pair
    op); a site following guidance is refused by name, and nothing is written."""
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(5, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([13, 2, 30, 7, 21])
    spec = KVCacheSpec(("bf16", "nvfp4"), num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    caches = [random_cache(spec, "cpu") for _ in range(2)]
    start = page_bytes(caches[0])
    guidance = {(1, s): ops.quantize(x, scaling="row") for s, x in (("k", k), ("v", v))}
    capture = None if kept is None else Keeps(*kept)
    kv = NewKV(k, v, Nvfp4KV(1, guided_sites), guidance if guided else None, capture)
    if refused is not None:
        with pytest.raises(ValueError, match=rf"layers.1 site '{refused}' follows guidance"):
            kv.store(caches[0], 1, slots)
        assert pair_calls == [] and torch.equal(page_bytes(caches[0]), start)
        return
    kv.store(caches[0], 1, slots)
    assert len(pair_calls) == 1
    caches[1].write(1, slots, k, v)
    assert_bitwise(page_bytes(caches[0]), page_bytes(caches[1]), "pages")
    recorded = {key[1] for key in capture.sites} if capture is not None else set()
    assert recorded == set(kept or ()) & {"k", "v"}


def test_pair_errors_name_the_layer(monkeypatch):
    def refuse(*args):
        raise ValueError("v_pages must be [N, P, heads, K]")

    monkeypatch.setattr(ops, "quantize_into_pair", refuse)
    spec = KVCacheSpec(layer_formats=("nvfp4",), num_kv_heads=2, head_dim=32, dtype=torch.float32)
    cache = KVCache(spec, num_blocks=2, block_size=4, device="cpu")
    k = torch.zeros(1, 2, 32)
    with pytest.raises(ValueError, match=r"layers.0 K/V: v_pages must be"):
        NewKV(k, k, Nvfp4KV(0, ())).store(cache, 0, torch.tensor([3]))
