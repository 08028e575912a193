"""The experts' SwiGLU kernel against the eager formulation (`experts.eager_swiglu`), and its
fused intermediate site against the fake quantization of its own output, bit for bit."""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import assert_record_equal, assert_same_values  # noqa: E402

from fp4rl.fp4 import reference as R  # noqa: E402
from fp4rl.kernels import swiglu  # noqa: E402
from fp4rl.kernels.launch import permuted_rows  # noqa: E402
from fp4rl.model.experts import eager_swiglu  # noqa: E402


def gate_up(A, I, seed, scale=4.0):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(A, 2 * I, generator=g) * scale).to(torch.bfloat16)


def every_bf16_gate(I=512):  # noqa: E741
    """All 65,536 BF16 values as gates (NaNs, infinities, signed zeros included), up 1.5."""
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = gates.view(-1, I)
    return torch.cat([gates, torch.full_like(gates, 1.5)], dim=1)


def check_against_eager(x: torch.Tensor, device: str) -> None:
    """Bitwise on the GPU (NaN payloads aside); under the interpreter (numpy's exp) within one
    unit in the last place and over 99 % bitwise, except where the silu of a gate is an FP32
    subnormal (|gate| < 2**-124), which the interpreter does not round as the GPU does."""
    got = swiglu.launch(x.to(device)).cpu()
    want = eager_swiglu(x.to(device)).cpu()
    if device == "cuda":
        assert_same_values(got, want, f"swiglu {tuple(x.shape)}")
        return
    assert torch.equal(got.isnan(), want.isnan())
    g, w = got.float(), want.float()
    ulp = 2.0 ** (torch.floor(torch.log2(w.abs())) - 7)
    tiny = x[:, : x.shape[1] // 2].float().abs() < 2.0**-124
    close = (g == w) | ((g - w).abs() <= ulp) | tiny
    assert (close | w.isnan()).all()
    assert ((g == w) | tiny | w.isnan()).float().mean() > 0.99


@pytest.mark.parametrize(("A", "I"), [(1, 768), (5, 32), (17, 48), (3, 256)])
def test_kernel_equals_eager(device, A, I):  # noqa: E741
    check_against_eager(gate_up(A, I, seed=A * I), device)


def test_every_bf16_gate(device):
    check_against_eager(every_bf16_gate(), device)


@pytest.mark.parametrize(("A", "I"), [(1, 768), (7, 48), (4, 256), (0, 32)])
def test_fused_site_is_the_fake_quantization_of_the_output(device, A, I):  # noqa: E741
    x = gate_up(A, I, seed=A + I).to(device)
    if A > 2:
        x[1] = 0.0  # a zero row: zero scales, zero values
        x[2, 3] = float("inf")  # an inf gate poisons its row's scale
    h = swiglu.launch(x)
    got = swiglu.launch(x, quantize=True)
    want = R.dequantize(R.quantize(h.cpu(), scaling="row"), torch.bfloat16)
    assert_same_values(got, want, f"swiglu + site {tuple(x.shape)}")


@pytest.mark.parametrize("form", ["full", "compact"])
@pytest.mark.parametrize(("A", "I", "ordered"), [(1, 768, True), (12, 48, True), (6, 256, False)])
def test_the_record_from_the_same_launch(device, form, A, I, ordered):  # noqa: E741
    """`launch_recording`: the values of `launch` with quantize, and the site's record of h
    (full or compact), rows picked by ``row_order`` ([T, k] over a permutation) where given:
    bitwise the reference's quantization of those rows of h, special rows included."""
    x = gate_up(A, I, seed=A + 2 * I).to(device)
    if A > 4:
        x[1] = 0.0
        x[2, 3] = float("inf")
        x[4, I + 5] = float("nan")
    g = torch.Generator().manual_seed(A)
    order = torch.randperm(A, generator=g).view(-1, 3 if A % 3 == 0 else 1) if ordered else None
    h_q, record = swiglu.launch_recording(x, form, None if order is None else order.to(device))
    assert_same_values(h_q, swiglu.launch(x, quantize=True).cpu(), "values")
    h = swiglu.launch(x).cpu()
    rows = h if order is None else h[order.flatten()].view(*order.shape, I)
    assert_record_equal(record, R.quantize(rows, scaling="row"), form, f"{form} record")


@pytest.mark.parametrize(("I", "step"), [(768, 256), (64, 32), (256, 64)])
def test_permuted_rows_are_the_rows_permuted(device, I, step):  # noqa: E741
    """With ``permuted_by`` the values, quantized or not, are stored in `permuted_rows`' order;
    the record from the same launch stays in real order."""
    x = gate_up(5, I, seed=I + step).to(device)
    for quantize in (False, True):
        want = permuted_rows(swiglu.launch(x, quantize=quantize).cpu(), step)
        got = swiglu.launch(x, quantize=quantize, permuted_by=step)
        assert_same_values(got, want, f"quantize={quantize}")
    order = torch.arange(5, device=device).flip(0)
    h_q, record = swiglu.launch_recording(x, "full", order, permuted_by=step)
    want_q, want_record = swiglu.launch_recording(x, "full", order)
    assert_same_values(h_q, permuted_rows(want_q.cpu(), step), "recorded values")
    assert_record_equal(record, want_record, "full", "the record")
    with pytest.raises(ValueError, match=f"rows of {I} values cannot be permuted in steps of 512"):
        swiglu.launch(x, permuted_by=512)


def test_the_record_checks_name_the_values(device):
    x = gate_up(6, 32, seed=0).to(device)
    with pytest.raises(ValueError, match=r"record form must be 'full', 'compact' or None; got "
                       r"'codes'"):  # fmt: skip
        swiglu.launch_recording(x, "codes")
    with pytest.raises(ValueError, match="needs a record form"):
        swiglu.launch_recording(x, None)
    order = torch.arange(6, device=device)
    with pytest.raises(ValueError, match=r"row_order must be int64 with one entry per row of "
                       r"gate_up \(6\); got torch.int32 of shape \(6,\)"):  # fmt: skip
        swiglu.launch_recording(x, "full", order.int())
    with pytest.raises(ValueError, match=r"got torch.int64 of shape \(5,\)"):
        swiglu.launch_recording(x, "full", order[:5])
    empty, record = swiglu.launch_recording(x[:0], "compact", order[:0].view(0, 8))
    assert empty.shape == (0, 32) and record.mantissa_bits.shape == (0, 8, 4)


@pytest.mark.parametrize("quantize", [False, True])
def test_rows_do_not_depend_on_the_launch_size(device, quantize):
    """A decode batch (one row per program, 8 warps) and a long one (several rows, 4 warps)
    give the same rows."""
    I = 32  # noqa: E741
    assert swiglu.rows_per_program(7, I) == 1 < swiglu.rows_per_program(swiglu.FEW_ROWS, I)
    assert swiglu.warps_for(7) != swiglu.warps_for(swiglu.FEW_ROWS)
    x = gate_up(swiglu.FEW_ROWS + 3, I, seed=5).to(device)
    many = swiglu.launch(x, quantize=quantize)
    few = swiglu.launch(x[:7], quantize=quantize)
    assert_same_values(few, many[:7].cpu(), "first 7 rows")
    # Any other rows a program and warps, as benchmarks/swiglu.py times them: the same rows.
    other = swiglu.launch(x, quantize=quantize, rows=4, num_warps=2)
    assert_same_values(other, many.cpu(), "4 rows a program on 2 warps")


def test_checks_name_the_values(device):
    x = gate_up(2, 32, seed=0).to(device)
    with pytest.raises(ValueError, match=r"rows must be a power of two; got 3"):
        swiglu.launch(x, rows=3)
    with pytest.raises(ValueError, match=r"num_warps must be a power of two; got 6"):
        swiglu.launch(x, num_warps=6)
    with pytest.raises(ValueError, match=r"got torch.float32 of shape \(2, 64\)"):
        swiglu.launch(x.float())
    with pytest.raises(
        ValueError, match=r"I a multiple of 16 .*; got torch.bfloat16 of shape \(2, 48\)"
    ):
        swiglu.launch(x[:, :48].contiguous())
    with pytest.raises(ValueError, match="gate_up must be contiguous"):
        swiglu.launch(torch.cat([x, x], dim=1)[:, ::2])
