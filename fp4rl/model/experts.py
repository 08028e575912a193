"""Routed experts: one computation, three ways to hold the weights.

All three run the same SwiGLU over tokens sorted by expert (a grouped GEMM):

- `Experts`: BF16 parameters, BF16 compute (boundary layers, or the whole model in BF16).
- `QatExperts`: BF16 parameters, W4A4 fake quantization (the trainer): weights quantized with one
  global scale per expert shared by W1 and W3 and another for W2; the expert input quantized
  once per token and the intermediate once per token-expert row; gradients straight through.
  (`QatWeightExperts`: the weights alone, activations BF16 — an asymmetric baseline.)
- `PackedExperts`: weights stored as `NVFP4Tensor` (4.5 bits per weight; the rollout), the same
  activation sites; the grouped GEMM decodes them to the compute dtype (in registers on the
  GPU, `fp4rl.ops.grouped_mm`) for BF16 tensor-core math.

The weight values the GEMMs see are bitwise equal between QAT and packed experts built from the
same BF16 weights; only the accumulation order of the GEMM kernel may differ.

Legend: T tokens, k experts per token, A = T*k assignments, E experts, H hidden, I intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp4rl import ops
from fp4rl.fp4 import NVFP4Tensor
from fp4rl.model.precision import EXPERT_SITES
from fp4rl.model.sites import Capture, Fp4Site
from fp4rl.ops import dequantize, fake_quantize, grouped_mm, quantize
from fp4rl.records import GuidanceMap


class RoutedExperts(nn.Module):
    """The dispatch all three variants share; subclasses say how weights and sites look."""

    def __init__(self, num_experts: int, intermediate: int, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_experts, self.intermediate = num_experts, intermediate

    def weights(self) -> tuple[torch.Tensor | NVFP4Tensor, torch.Tensor | NVFP4Tensor]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` as the GEMMs take them (`fp4rl.ops.grouped_mm`:
        tensors, or packed NVFP4 weights it decodes itself)."""
        raise NotImplementedError

    def input_site(self, x_TH, guidance, capture):
        return x_TH

    def input_on_the_way(self, guidance, capture) -> str | None:
        """Whether a caller may make the input site's values on the way (`forward`'s
        ``x_site_TH``: an FP4 site rounding to nearest), and which record of them with them
        (``x_site_record``): "" none, else its form (`fp4rl.model.sites.Fp4Site.on_the_way`).
        None here: these experts' input has no site."""
        return None

    def keep_input(self, capture, record) -> None:
        raise RuntimeError(f"layers.{self.layer}: these experts' input has no site to record")

    def input_rows_step(self, x_TH: torch.Tensor, top_k: int) -> int | None:
        """The K step in which the gate/up GEMM reads a caller-made input site's values
        (`forward`'s ``x_site_TH``) for tokens like ``x_TH`` stored permuted
        (`fp4rl.ops.expert_rows_step`), for the caller to make them so; None: in real order."""
        return self.rows_step(x_TH, "w13", x_TH.shape[0] * top_k)

    def rows_step(self, x: torch.Tensor, gemm: str, rows: int) -> int | None:
        """The K step in which GEMM ``gemm`` ("w13" or "w2") of ``rows`` rows like ``x`` reads
        them stored permuted (`fp4rl.ops.expert_rows_step`); None here, where the weights are
        tensors: in real order."""
        return None

    def hidden_site(self, h_AI, row_order_Tk, guidance, capture):
        return h_AI

    def intermediate_values(self, gate_up_A2I, row_order_Tk, guidance, capture):
        """``(h, permuted_by)``: what the down GEMM multiplies, the SwiGLU of ``gate_up``
        through the intermediate site, and the K step its rows are stored permuted in (None:
        real order)."""
        return self.hidden_site(swiglu(gate_up_A2I), row_order_Tk, guidance, capture), None

    def forward(
        self,
        x_TH: torch.Tensor,
        topk_ids_Tk: torch.Tensor,
        topk_weights_Tk: torch.Tensor,
        guidance: GuidanceMap | None = None,
        capture: Capture | None = None,
        *,
        x_site_TH: torch.Tensor | None = None,
        x_site_record=None,
        x_site_permuted_by: int | None = None,
    ) -> torch.Tensor:
        """``x_site_TH``, where given, is ``input_site(x_TH, ...)`` made by the caller (where
        `input_on_the_way` allows, bit for bit what the site returns): it is used in its place,
        and ``x_site_record`` (the site's record, where the capture keeps one) is kept. Its
        rows are stored permuted in K steps of ``x_site_permuted_by`` where given (the step
        `input_rows_step` named)."""
        k = topk_ids_Tk.shape[1]
        w13, w2 = self.weights()
        x_permuted_by = None
        if x_site_TH is None:
            x_TH = self.input_site(x_TH, guidance, capture)
        else:
            x_TH, x_permuted_by = x_site_TH, x_site_permuted_by
            if x_site_record is not None:
                self.keep_input(capture, x_site_record)
        # Sort the T*k assignments by expert so each expert's rows are contiguous;
        # row_order[t, j]: the sorted row that holds assignment (t, j).
        order_A, row_order_Tk, counts_E = dispatch_order(topk_ids_Tk, self.num_experts)
        # Row a of the product is token order_A[a] // k (gathered by the GEMM).
        gate_up_A2I = grouped_mm(
            x_TH, w13, counts_E, order_A=order_A, top_k=k, x_permuted_by=x_permuted_by
        )
        h_AI, h_permuted_by = self.intermediate_values(gate_up_A2I, row_order_Tk, guidance, capture)
        y_AH = grouped_mm(h_AI, w2, counts_E, x_permuted_by=h_permuted_by)
        # Weighted sum over each token's k experts, back in token order.
        return combine(y_AH, row_order_Tk, topk_weights_Tk)


def dispatch_order(
    topk_ids_Tk: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order_A, row_order_Tk, counts_E)``: the assignments ordered by expert
    (`sort_by_expert`), the inverse permutation shaped ``[T, k]`` (``row_order[t, j]`` the
    sorted row that holds assignment ``(t, j)``) and the assignments per expert
    (`expert_counts`); int64 all. On the GPU, sorts of decode size are one kernel that gives
    all three (`fp4rl.ops.sort_by_expert`); elsewhere torch sorts, the inverse is a scatter of
    ``arange(A)`` and the counts an index-add. The same integers either way."""
    kernel_result = ops.sort_by_expert(topk_ids_Tk, num_experts)
    if kernel_result is not None:
        order_A, inverse_A, counts_E = kernel_result
    else:
        order_A = sort_by_expert(topk_ids_Tk, num_experts)
        positions_A = torch.arange(order_A.numel(), device=order_A.device)
        inverse_A = torch.empty_like(order_A).scatter_(0, order_A, positions_A)
        counts_E = expert_counts(topk_ids_Tk, num_experts)
    return order_A, inverse_A.view(topk_ids_Tk.shape), counts_E


def swiglu(gate_up_A2I: torch.Tensor) -> torch.Tensor:
    """`eager_swiglu`; on the GPU one kernel (`fp4rl.ops.swiglu`, bit for bit) where no
    gradient is wanted of it."""
    if not gate_up_A2I.requires_grad:
        h_AI = ops.swiglu(gate_up_A2I)
        if h_AI is not None:
            return h_AI
    return eager_swiglu(gate_up_A2I)


def eager_swiglu(gate_up_A2I: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of rows ``[gate | up]``: the formulation `fp4rl.kernels.swiglu`
    follows bit for bit."""
    gate, up = gate_up_A2I.chunk(2, dim=-1)
    return F.silu(gate) * up


def sort_by_expert(topk_ids_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The assignments ``[T, k]`` ordered by expert, ties in flat order: int64 ``[A]``, the
    permutation ``torch.argsort(ids.flatten(), stable=True)`` gives, bit for bit.

    The ids must lie in ``[0, num_experts)`` (the router's top-k, replayed rows filled in
    before the experts run); nothing checks this, since that would read them on the host.
    Each assignment ``a`` gets the key ``id * A + a``: keys are unique, and they order by id
    first and by position among equal ids, so the one order that sorts them is the stable
    one and any sort returns it, its indices being that permutation. The keys fit int32 when
    ``E * A < 2**31``; on the GPU an unstable sort of int32 keys is the cheap one (a bitonic
    sort in one block up to 32 keys, half the radix passes of int64 ids beyond). Past that
    bound the ids themselves are sorted stably. On the GPU, sorts of decode size (shapes
    decide: `fp4rl.kernels.expert_sort.supported`) are instead one counting-sort kernel
    (`fp4rl.ops.sort_by_expert`), the same permutation. Nothing is read back to the host.
    """
    kernel_result = ops.sort_by_expert(topk_ids_Tk, num_experts)
    if kernel_result is not None:
        return kernel_result[0]
    ids_A = topk_ids_Tk.flatten()
    A = ids_A.numel()
    if num_experts * A >= 2**31:
        return torch.argsort(ids_A, stable=True)
    keys_A = torch.arange(A, dtype=torch.int32, device=ids_A.device)
    keys_A.add_(ids_A.to(torch.int32), alpha=A)
    return torch.sort(keys_A).indices


def combine(
    y_AH: torch.Tensor, row_order_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor
) -> torch.Tensor:
    """Each token's expert outputs weighted by its top-k weights and summed: ``[T, H]`` in y's
    dtype, the arithmetic of `eager_combine`. On the GPU one kernel (`fp4rl.ops.moe_combine`,
    the k products summed in a fixed FP32 order, so a token's result does not depend on the
    batch), for the engine and, with the eager formulation's gradients, for the trainer;
    elsewhere (or for shapes the kernel does not take) the eager formulation."""
    if torch.is_grad_enabled() and (y_AH.requires_grad or topk_weights_Tk.requires_grad):
        if y_AH.is_cuda:
            return _KernelCombine.apply(y_AH, row_order_Tk, topk_weights_Tk)
        return eager_combine(y_AH, row_order_Tk, topk_weights_Tk)
    out_TH = ops.moe_combine(y_AH, row_order_Tk, topk_weights_Tk)
    return eager_combine(y_AH, row_order_Tk, topk_weights_Tk) if out_TH is None else out_TH


def eager_combine(
    y_AH: torch.Tensor, row_order_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor
) -> torch.Tensor:
    """The combine as torch ops: gather each token's k sorted rows, multiply by the weights
    cast to y's dtype (each product rounded to it), sum over k (in FP32, rounded once)."""
    T, k = row_order_Tk.shape
    y_TkH = y_AH[row_order_Tk.flatten()].view(T, k, y_AH.shape[-1])
    return (y_TkH * topk_weights_Tk.unsqueeze(-1).to(y_TkH.dtype)).sum(1)


class _KernelCombine(torch.autograd.Function):
    """The kernel's values forward; backward, the gradients of `eager_combine` (the same
    function up to the order of its FP32 sum), recomputed."""

    @staticmethod
    def forward(ctx, y_AH, row_order_Tk, topk_weights_Tk):
        ctx.save_for_backward(y_AH, row_order_Tk, topk_weights_Tk)
        out_TH = ops.moe_combine(y_AH, row_order_Tk, topk_weights_Tk)
        return eager_combine(y_AH, row_order_Tk, topk_weights_Tk) if out_TH is None else out_TH

    @staticmethod
    def backward(ctx, grad_TH):
        y_AH, row_order_Tk, weights_Tk = ctx.saved_tensors
        with torch.enable_grad():
            y_AH, weights_Tk = y_AH.detach().requires_grad_(), weights_Tk.detach().requires_grad_()
            dy_AH, dweights_Tk = torch.autograd.grad(
                eager_combine(y_AH, row_order_Tk, weights_Tk), (y_AH, weights_Tk), grad_TH
            )
        return dy_AH, None, dweights_Tk


def expert_counts(topk_ids_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, int64 ``[E]``, without a device sync (`torch.bincount` on CUDA
    reads the ids' min and max on the host: two syncs per MoE layer and step, which kept the
    host from running ahead of the GPU)."""
    ids = topk_ids_Tk.flatten()
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts_E.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int64))


class Experts(RoutedExperts):
    """BF16 routed experts: BF16 parameters, BF16 compute."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, layer: int) -> None:
        super().__init__(num_experts, intermediate, layer)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def weights(self):
        return self.w13, self.w2


class Fp4Sites:
    """The two W4A4 activation sites: the expert input per token, the intermediate per
    token-expert row (mixed into `QatExperts` and `PackedExperts`)."""

    def init_sites(self, layer: int, guided_sites: tuple[str, ...]) -> None:
        self._input = Fp4Site(layer, "expert_input", "expert_input" in guided_sites)
        self._hidden = Fp4Site(layer, "expert_hidden", "expert_hidden" in guided_sites)

    def input_site(self, x_TH, guidance, capture):
        return self._input(x_TH, guidance, capture)

    def input_on_the_way(self, guidance, capture) -> str | None:
        return self._input.on_the_way(guidance, capture)

    def keep_input(self, capture, record) -> None:
        self._input.keep(capture, record)

    def hidden_site(self, h_AI, row_order_Tk, guidance, capture):
        return self._hidden(h_AI, guidance, capture, row_order=row_order_Tk)

    def intermediate_values(self, gate_up_A2I, row_order_Tk, guidance, capture):
        """Where no gradient is wanted (the engine) and the intermediate site rounds to nearest
        (`Fp4Site.on_the_way`), on the GPU one kernel makes the site's values from ``gate_up``
        (`fp4rl.ops.swiglu`, the same bits as the SwiGLU then the site), their rows stored as
        the down GEMM reads them (`fp4rl.ops.expert_rows_step`), and, where the capture keeps
        it, the site's record in token order (`fp4rl.ops.swiglu_site`)."""
        form = self._hidden.on_the_way(guidance, capture)
        if not gate_up_A2I.requires_grad and form is not None:
            step = self.rows_step(gate_up_A2I, "w2", gate_up_A2I.shape[0])
            if form == "":
                h_AI = ops.swiglu(gate_up_A2I, quantize=True, permuted_by=step)
                if h_AI is not None:
                    return h_AI, step
            else:
                made = ops.swiglu_site(gate_up_A2I, form, row_order_Tk, step)
                if made is not None:
                    h_AI, record = made
                    self._hidden.keep(capture, record)
                    return h_AI, step
        return super().intermediate_values(gate_up_A2I, row_order_Tk, guidance, capture)


class QatExperts(Fp4Sites, Experts):
    """Fake-quantized W4A4 experts for training (straight-through gradients)."""

    def __init__(self, num_experts, hidden, intermediate, layer, *, guided_sites=EXPERT_SITES):
        super().__init__(num_experts, hidden, intermediate, layer)
        self.init_sites(layer, guided_sites)

    def weights(self):
        # One global scale per expert: over W1 and W3 together in w13, over W2 alone in w2.
        return fake_quantize(self.w13, scaling=2), fake_quantize(self.w2, scaling=2)


class QatWeightExperts(Experts):
    """Fake-quantized W4 weights, BF16 activations (W4A16): the trainer of the asymmetric
    baseline, which leaves the rollout's activation rounding unmodelled."""

    def __init__(self, num_experts, hidden, intermediate, layer, *, guided_sites=()):
        super().__init__(num_experts, hidden, intermediate, layer)

    weights = QatExperts.weights


class PackedExperts(Fp4Sites, RoutedExperts):
    """Rollout experts: weights held packed as NVFP4 and quantized when they are loaded."""

    def __init__(self, num_experts, hidden, intermediate, layer, *, guided_sites=EXPERT_SITES):
        super().__init__(num_experts, intermediate, layer)
        self.init_sites(layer, guided_sites)
        self.compute_dtype = torch.bfloat16
        self.w13_packed: NVFP4Tensor | None = None
        self.w2_packed: NVFP4Tensor | None = None

    @torch.no_grad()
    def quantized(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        """Quantize BF16 ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, one global scale per expert
        for W1+W3 together and one for W2. Nothing is stored (see `install`)."""
        E, I = self.num_experts, self.intermediate
        for name, w, lead in (("w13", w13, (E, 2 * I)), ("w2", w2, (E,))):
            if tuple(w.shape[: len(lead)]) != lead:
                raise ValueError(
                    f"layers.{self.layer}.mlp.experts.{name}: got shape {tuple(w.shape)}"
                )
        return quantize(w13.contiguous(), scaling=2), quantize(w2.contiguous(), scaling=2)

    @torch.no_grad()
    def install(self, w13: NVFP4Tensor, w2: NVFP4Tensor, dtype: torch.dtype) -> None:
        """Hold the packed weights; on a refit, copy into the storage already held, so that
        anything captured against it (CUDA graphs) stays valid."""
        if self.w13_packed is None or self.w13_packed.shape != w13.shape:
            self.w13_packed, self.w2_packed = w13, w2
        else:
            for old, new in zip(
                (*self.w13_packed.tensors(), *self.w2_packed.tensors()),
                (*w13.tensors(), *w2.tensors()),
                strict=True,
            ):
                old.copy_(new)
        self.compute_dtype = dtype

    def rows_step(self, x, gemm, rows):
        w = self.w13_packed if gemm == "w13" else self.w2_packed
        return None if w is None else ops.expert_rows_step(x, w, rows)

    def weights(self):
        # Packed: the grouped GEMM decodes them (in registers on the GPU), to the same values
        # as `dequantized()`.
        if self.w13_packed is None or self.w2_packed is None:
            raise RuntimeError(f"layers.{self.layer}.mlp.experts: no weights loaded")
        return self.w13_packed, self.w2_packed

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight values the GEMMs multiply by, in the compute dtype."""
        return tuple(dequantize(w, self.compute_dtype) for w in self.weights())
