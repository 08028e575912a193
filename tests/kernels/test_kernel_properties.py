"""Property test: on any input hypothesis finds, the kernels equal the reference bit for bit."""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kernel_checks import DTYPES, assert_nvfp4_equal, assert_same_values, cpu  # noqa: E402

from fp4rl import kernels  # noqa: E402
from fp4rl.fp4 import reference as R  # noqa: E402

# Values from every region the recipe treats differently: zeros of both signs, denormals,
# tiny and huge normals, exact E2M1 grid points and ties, and the non-finite values.
SPECIAL = [0.0, -0.0, 2.0**-149, -(2.0**-130), 1e-38, 2.0**-117, 0.25, -0.75, 5.0, 6.0, 448.0,
           3e38, float("inf"), -float("inf"), float("nan")]  # fmt: skip
VALUES = st.one_of(
    st.floats(-1e4, 1e4, width=32),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.sampled_from(SPECIAL),
)


@st.composite
def inputs(draw):
    lead = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    k = 16 * draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(DTYPES))
    scaling = draw(st.sampled_from(["row", "tensor", *range(1, len(lead) + 2)]))
    numel = k * int(torch.tensor(lead).prod())
    # Mostly ordinary values, so that most groups are live; a few specials each example.
    ordinary = draw(st.lists(st.floats(-100, 100, width=32), min_size=numel, max_size=numel))
    specials = draw(st.lists(st.tuples(st.integers(0, numel - 1), VALUES), max_size=4))
    for index, value in specials:
        ordinary[index] = value
    x = torch.tensor(ordinary, dtype=torch.float32).view(*lead, k).to(dtype)
    return x, scaling


@settings(max_examples=40, deadline=None)
@given(inputs())
def test_quantize_and_fake_quantize_equal_reference(case):
    x, scaling = case
    device = "cuda" if torch.cuda.is_available() else "cpu"
    want = R.quantize(x, scaling=scaling)
    got = kernels.quantize(x.to(device), scaling=scaling)
    assert_nvfp4_equal(cpu(got), want, f"{x.dtype} {tuple(x.shape)} {scaling!r}")
    fake = kernels.fake_quantize(x.to(device), scaling=scaling)
    assert_same_values(fake, R.dequantize(want, x.dtype), "fake_quantize")
