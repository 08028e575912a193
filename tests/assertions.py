"""One way to compare NVFP4 tensors and site records, for every test folder.

Codes and scales are compared bit for bit; float outputs bit for bit too, except that any NaN
matches any NaN (the spec fixes where NaN appears, not its payload). Records computed twice
from reordered work, or by the trainer following the rollout, have their own named checks with
the tolerance each can honestly be held to.
"""

import dataclasses

import torch

from fp4rl.fp4 import NVFP4Tensor, rounding
from fp4rl.fp4.reference import unpack_e2m1

INT_OF = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.uint8: torch.uint8,
}


def _first_mismatch(got: torch.Tensor, want: torch.Tensor, bad: torch.Tensor, what: str) -> str:
    index = tuple(int(i) for i in bad.nonzero()[0])
    return (
        f"{what}: {int(bad.sum())} of {bad.numel()} differ; first at {index}: "
        f"got {got[index].item()!r} want {want[index].item()!r}"
    )


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    )
    got_bits, want_bits = got.view(INT_OF[got.dtype]), want.view(INT_OF[want.dtype])
    bad = got_bits != want_bits
    assert not bad.any(), _first_mismatch(got_bits, want_bits, bad, what)


def assert_same_values(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equal, NaN positions equal (NaN payloads free)."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    )
    nan = want.isnan()
    got_bits, want_bits = got.view(INT_OF[got.dtype]), want.view(INT_OF[want.dtype])
    bad = torch.where(nan, ~got.isnan(), got_bits != want_bits)
    assert not bad.any(), _first_mismatch(got, want, bad, what)


def assert_nvfp4_equal(got, want, what: str = "") -> None:
    """Every member of two `NVFP4Tensor`s (or two `NVFP4Rows`) bitwise; in the float members
    (global scales, the rows' amaxes) any NaN matches any NaN, as in every float output (a
    GPU's conversion of an FP32 NaN to BF16 keeps another payload than torch's on the CPU)."""
    assert type(got) is type(want), f"{what}: {type(got).__name__} vs {type(want).__name__}"
    for field, g, w in zip(dataclasses.fields(got), got.tensors(), want.tensors(), strict=True):
        if w.dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert_same_values(g, w, f"{what} {field.name}")
        else:
            assert_bitwise(g, w, f"{what} {field.name}")


def assert_record_equal(got, want: NVFP4Tensor, form: str, what: str = "") -> None:
    """A site record a kernel made in ``form`` against the `NVFP4Tensor` it stands for:
    "full" that tensor itself, "compact" its `rounding.compact`, every member bitwise."""
    if form == "full":
        assert_nvfp4_equal(cpu(got), cpu(want), what)
        return
    want = rounding.compact(cpu(want))
    assert type(got) is type(want), f"{what}: {type(got).__name__} vs {type(want).__name__}"
    for field in dataclasses.fields(want):
        g, w = getattr(got, field.name), getattr(want, field.name)
        assert_bitwise(g.cpu(), w, f"{what} {field.name}")


def cpu(t: NVFP4Tensor) -> NVFP4Tensor:
    return t.map(lambda m: m.cpu())


def assert_matches_rollout(got: NVFP4Tensor, rollout: NVFP4Tensor, what: str = "") -> None:
    """The trainer's record of a site it rounded with the rollout's full guidance: scales
    bitwise, codes bitwise except that a zero code may differ in its sign bit (a trainer value
    of the other sign than the rollout's tiny one rounds to +0 where the rollout had -0; guided
    rounding keeps the local sign, docs/numerics.md); both dequantize to zero."""
    got = got.map(lambda m: m.cpu())
    rollout = rollout.map(lambda m: m.cpu())
    assert_bitwise(got.block_scale, rollout.block_scale, f"{what} block_scale")
    assert_bitwise(got.global_scale, rollout.global_scale, f"{what} global_scale")
    a, b = unpack_e2m1(got.codes), unpack_e2m1(rollout.codes)
    a, b = (torch.where(c & 7 == 0, torch.zeros_like(c), c) for c in (a, b))
    assert_bitwise(a, b, f"{what} codes (zero's sign aside)")


def assert_records_close(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    """Two independent computations of one site under different batching: global scales move
    by FP32 rounding (amax of values that differ in their last bits), so codes and block scales
    may differ where a scaled value sits at a rounding boundary. Observed in FP32: no code or
    block scale differs; global scales within 1.3e-6 relative."""
    torch.testing.assert_close(a.global_scale, b.global_scale, rtol=1e-5, atol=0)
    codes_a, codes_b = unpack_e2m1(a.codes), unpack_e2m1(b.codes)
    assert (codes_a != codes_b).float().mean() <= 1e-3
    assert (a.block_scale.float() != b.block_scale.float()).float().mean() <= 1e-3
