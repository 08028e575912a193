"""The engine's expert GEMMs fed rows their producers stored permuted (`moe_gemm.PERMUTED_ROWS`,
a trial switch): the post-attention norm's site kernel writes the gate/up GEMM's input, and the
SwiGLU's site kernel the down GEMM's, in `launch.permuted_rows`' order for the K step each GEMM
reads, and each GEMM is told that step. The model's logits and the site records it keeps are
those of rows in real order, bit for bit.

On the CPU the register GEMM cannot run, so its stand-in puts the rows back in real order with
the step it was told and runs the plain product: a producer and a GEMM that disagree on the
step, or a GEMM not told, change the logits. On the GPU the real kernels run."""

import pytest
import torch
from tiny_models import packed_twin, qat_model, tiny_config, tiny_precision

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import assert_bitwise, assert_same_values  # noqa: E402

from fp4rl import kernels, ops  # noqa: E402
from fp4rl.fp4.tensor import NVFP4Tensor  # noqa: E402
from fp4rl.kernels import moe_gemm  # noqa: E402
from fp4rl.model import experts  # noqa: E402
from fp4rl.model.attention import CausalAttention  # noqa: E402
from fp4rl.model.moe import SparseMoeBlock  # noqa: E402
from fp4rl.rollout.capture import StepCapture  # noqa: E402

STEP = 64  # the stand-in GEMM's K step: w13's K (hidden 64) and w2's (intermediate 64)


def tiny_packed(device):
    """The tiny rollout model with experts of 64 intermediate values (so that both GEMMs'
    rows permute in a step of 64), its FP4 layers' experts packed."""
    precision = tiny_precision()
    config = tiny_config(moe_intermediate_size=64)
    qat = qat_model(precision, dtype=torch.bfloat16, config=config, device=device)
    return packed_twin(qat, precision)


def real_order(x: torch.Tensor, step: int) -> torch.Tensor:
    """The inverse of `launch.permuted_rows`."""
    R, K = x.shape
    return x.reshape(R, K // step, step // 32, 4, 8).transpose(2, 3).reshape(R, K)


def interpreted(op):
    """``op`` (an `fp4rl.ops` function) with CPU tensors sent to the kernels, under Triton's
    interpreter."""

    def run(*args, **kwargs):
        real = ops._kernels
        ops._kernels = lambda x: kernels
        try:
            return op(*args, **kwargs)
        finally:
            ops._kernels = real

    return run


def forward(model, tokens, permute: bool, device, monkeypatch, keep=None):
    """``(logits, the steps each expert GEMM was told, the records kept)`` of one forward in
    inference mode; ``permute``: whether the GEMMs ask for permuted rows."""
    told = []
    real_grouped_mm = experts.grouped_mm
    with monkeypatch.context() as m:
        if device == "cuda":
            m.setattr(moe_gemm, "PERMUTED_ROWS", permute)
        else:
            for name in ("add_rms_norm_quantize", "swiglu", "swiglu_site"):
                m.setattr(ops, name, interpreted(getattr(ops, name)))
            packed_step = STEP if permute else None
            m.setattr(
                ops,
                "expert_rows_step",
                lambda x, w, rows: packed_step if isinstance(w, NVFP4Tensor) else None,
            )

        def grouped_mm(x, w, counts, *, x_permuted_by=None, **how):
            told.append(x_permuted_by)
            if device == "cuda" or x_permuted_by is None:
                return real_grouped_mm(x, w, counts, x_permuted_by=x_permuted_by, **how)
            return real_grouped_mm(real_order(x, x_permuted_by), w, counts, **how)

        m.setattr(experts, "grouped_mm", grouped_mm)
        capture = None if keep is None else StepCapture(routing=False, guidance="full", keep=keep)
        with torch.inference_mode():
            logits = model(tokens, CausalAttention([5, 3], device=device), capture=capture)
    return logits, told, ({} if capture is None else capture.sites)


@pytest.mark.parametrize("kept", [False, True], ids=["uncaptured", "records kept"])
def test_each_gemm_reads_the_rows_its_producer_permuted(device, monkeypatch, kept):
    """Both GEMMs of every FP4 layer are told the step their rows were stored in; the logits
    and the records of both expert sites (full codes) keep their bits."""
    check_each_gemm(device, monkeypatch, kept)


@pytest.mark.gpu
def test_each_gemm_reads_the_rows_its_producer_permuted_on_gpu(monkeypatch):
    """The same on the GPU's kernels (the GPU suite, ``-m gpu``, runs this one)."""
    for kept in (False, True):
        check_each_gemm("cuda", monkeypatch, kept)


def check_each_gemm(device, monkeypatch, kept):
    model = tiny_packed(device)
    fp4 = [p.index for p in model.plan.layers if p.fp4]
    keep = {(i, s) for i in fp4 for s in ("expert_input", "expert_hidden")} if kept else None
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6], device=device)
    want, told_real, want_kept = forward(model, tokens, False, device, monkeypatch, keep)
    got, told, got_kept = forward(model, tokens, True, device, monkeypatch, keep)
    moe = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert told_real == [None] * 2 * len(moe)
    # Both GEMMs of every FP4 layer; a BF16 MoE layer's experts read rows in real order.
    assert told == [STEP if i in fp4 else None for i in moe for _ in range(2)], told
    assert_same_values(got, want.cpu(), "logits")
    assert set(got_kept) == set(want_kept) == (keep or set())
    for key, record in want_kept.items():
        for name in ("codes", "block_scale", "global_scale"):
            got_member = getattr(got_kept[key], name).cpu()
            assert_bitwise(got_member, getattr(record, name).cpu(), f"{key} {name}")


def test_a_gemm_told_a_step_it_cannot_read_refuses():
    """Off the fused NVFP4 kernel (here, the CPU), rows said to be permuted are refused, not
    misread."""
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = ops.quantize(torch.randn(2, 32, 64), scaling=2)
    counts = torch.tensor([4, 0])
    with pytest.raises(ValueError, match="x_permuted_by=64: only the fused NVFP4 kernel"):
        ops.grouped_mm(x, w, counts, x_permuted_by=64)
    assert ops.expert_rows_step(x, w, 4) is None  # the CPU: real order


@pytest.mark.gpu
def test_the_switch_decides_on_gpu(monkeypatch):
    """Off, no GEMM asks for permuted rows; on, the decode sizes of Qwen3-30B-A3B's experts
    read them in the register tiles' 256-wide K steps, and from 5.5 rows per expert (the
    warpgroup MMA's tiles) in real order."""
    cuda = torch.device("cuda")
    assert moe_gemm.rows_step(cuda, 64 * 8, 128, 1536, 2048) is None
    monkeypatch.setattr(moe_gemm, "PERMUTED_ROWS", True)
    for tokens in (1, 8, 64, 88):
        assert moe_gemm.rows_step(cuda, tokens * 8, 128, 1536, 2048) == 256, tokens
        assert moe_gemm.rows_step(cuda, tokens * 8, 128, 2048, 768) == 256, tokens
    hopper = moe_gemm.on_warpgroup_mma(cuda, 1536, 2048)
    want = None if hopper else 128  # elsewhere the medium register tile
    assert moe_gemm.rows_step(cuda, 96 * 8, 128, 1536, 2048) == want
