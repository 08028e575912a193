"""One decode step of an engine, as `decode.py` times it: the engine's graph, or the eager
forward it stands for; and what a step launches (``--profile``: the kernels by GPU time,
``--count-ops``: the aten ops per decoder layer)."""

from __future__ import annotations

import collections
import math
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp4rl.rollout import Engine
from fp4rl.rollout.attention import AttentionMetadata, PagedAttention, Segment
from fp4rl.rollout.block_manager import BlockTable
from fp4rl.rollout.sequence import resolve_placeholders


def decode_step(
    engine: Engine, segments: list[Segment], tokens: list[int], capture=None, sampled_S=None
):
    """Logits of one decode step: the engine's graph, or (CPU) the eager forward it stands for.
    Placeholder tokens name rows of ``sampled_S``, the previous step's samples on the device."""
    if engine.graphs is not None:
        return engine.graphs.run(segments, tokens, capture, sampled_S)
    return eager_decode_step(engine, segments, tokens, capture, sampled_S)


def eager_decode_step(
    engine: Engine, segments: list[Segment], tokens: list[int], capture=None, sampled_S=None
):
    """The forward a decode step's graph replays, run op by op."""
    device = engine.layout.device
    meta = AttentionMetadata.build(segments, engine.config.block_size, device)
    attn = PagedAttention(engine.cache, meta)
    model = engine.model
    tokens_T = resolve_placeholders(torch.tensor(tokens, device=device), sampled_S)
    h = model.hidden_states(tokens_T, attn, capture=capture)
    return model.logits(h, dtype=None), capture


def decode_segments(engine: Engine, batch: int, context: int) -> list[Segment]:
    """One decode segment per sequence at ``context``: sequence i in blocks of its own, laid
    out one after another from block 0, with room for a few steps more."""
    per_seq = math.ceil((context + 4) / engine.config.block_size)
    return [
        Segment(BlockTable(range(i * per_seq, (i + 1) * per_seq)), context, 1) for i in range(batch)
    ]


def profile_case(engine: Engine, batch: int, context: int, top: int, title: str) -> None:
    """The ``top`` kernels of a few decode steps by GPU time (replayed graphs on the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    segments = decode_segments(engine, batch, context)
    tokens = [1] * batch
    activities = [ProfilerActivity.CPU]
    if engine.layout.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch.inference_mode(), profile(activities=activities) as prof:
        for _ in range(4):
            decode_step(engine, segments, tokens)
        if engine.layout.device.type == "cuda":
            torch.cuda.synchronize()
    device_sort = "cuda_time_total" if len(activities) == 2 else "cpu_time_total"
    print(f"### {title}: 4 decode steps")
    print(prof.key_averages().table(sort_by=device_sort, row_limit=top, max_name_column_width=70))


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it by (where, op): ``where`` is the decoder layer
    running (None outside the layers) and whether `fp4rl.ops`, the NVFP4 reference or the
    gathered attention issued the op (device-specific code: one Triton kernel, or
    ``torch._grouped_mm``, on the GPU). Views and allocations launch nothing and are left out."""

    SILENT = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach_",
              "aten::lift_fresh", "aten::_local_scalar_dense"}  # fmt: skip
    DEVICE_SPECIFIC = ("fp4rl/ops/", "fp4rl/fp4/", "fp4rl/kernels/")
    GATHERED = ("_gathered_decode", "attend_fp32")  # decode attention off the GPU

    def __init__(self, layers) -> None:
        super().__init__()
        self.layer, self.counts = None, collections.Counter()
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda *_, i=i: setattr(self, "layer", i))
            layer.register_forward_hook(lambda *_: setattr(self, "layer", None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not func.is_view and name not in self.SILENT:
            self.counts[(self.layer, self._device_specific(), name)] += 1
        return func(*args, **(kwargs or {}))

    def _device_specific(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            path = code.co_filename.replace("\\", "/")
            if any(p in path for p in self.DEVICE_SPECIFIC) or code.co_name in self.GATHERED:
                return True
            frame = frame.f_back
        return False


def count_ops(engine: Engine, batch: int, context: int, title: str) -> None:
    """Print the aten ops one eager decode step dispatches (on the GPU each launches at least
    one kernel), per decoder layer (their mean) and outside the layers, by op."""
    segments = decode_segments(engine, batch, context)
    counter = _OpCounter(engine.model.layers)
    # no_grad, not inference_mode: under inference_mode composite ops (to, linear) reach the
    # counter whole instead of as the ops that run.
    with torch.no_grad(), counter:
        eager_decode_step(engine, segments, [1] * batch)
    L = len(engine.model.layers)
    per_layer, outside = collections.Counter(), collections.Counter()
    for (layer, device_specific, name), n in counter.counts.items():
        (outside if layer is None else per_layer)[(device_specific, name)] += n
    model_ops = {name: n / L for (dev, name), n in per_layer.items() if not dev}
    device_ops = sum(n for (dev, _), n in per_layer.items() if dev) / L
    print(f"### {title}: aten ops of one decode step")
    print(f"per decoder layer: {sum(model_ops.values()):g} in the model's code, "
          f"{device_ops:g} in fp4rl.ops / the NVFP4 reference / gathered attention "
          f"(device-specific); outside the layers: {sum(outside.values())}")  # fmt: skip
    for name, n in sorted(model_ops.items(), key=lambda item: (-item[1], item[0])):
        print(f"  {n:6g}  {name}")
