"""Looking at a run: its metrics read back, mirrored to TensorBoard, plotted and summarized.

A run directory holds ``config.toml`` and ``metrics.jsonl`` (`fp4rl.loop`: one JSON object per
step, the last one the final evaluation). This module owns what is done with them afterwards:

- `read_metrics`: the entries of ``metrics.jsonl``, checked (a bad line is an error naming it);
- `TensorBoardLog`: every numeric metric of a step as a TensorBoard scalar (``run.tensorboard``),
  written by the loop beside ``metrics.jsonl``;
- `write_report`: PNG plots of what the run recorded and ``report.md``, a short summary.

It does not own which metrics exist (the loop, `fp4rl.train.observe`, `fp4rl.train.step`) and
imports nothing else of fp4rl. matplotlib and tensorboard are optional extras, imported only
when used.
"""

from __future__ import annotations

from pathlib import Path

REPORT_EXTRA = "pip install 'fp4rl[report]'"
TENSORBOARD_EXTRA = "pip install 'fp4rl[tensorboard]'"


def scalars(m: dict) -> dict[str, float]:
    """The numeric metrics of one entry (ints and floats, not bools), ``step`` left out."""
    return {
        k: float(v)
        for k, v in m.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class TensorBoardLog:
    """TensorBoard event files under ``<run_dir>/tensorboard``: `write` adds every numeric
    metric of an entry as a scalar at the entry's ``step`` and flushes, so a killed run loses
    nothing it wrote to ``metrics.jsonl``.

    ``purge_step``: a run resumed at step ``s`` passes ``s``, and TensorBoard hides the events
    an earlier attempt wrote at steps >= ``s`` (those steps are run again); None for a new
    run."""

    def __init__(self, run_dir: str | Path, *, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ModuleNotFoundError(
                f"run.tensorboard = true needs the tensorboard package ({err}): "
                f"{TENSORBOARD_EXTRA}",
                name="tensorboard",
            ) from None
        if purge_step is not None and (not isinstance(purge_step, int) or purge_step < 0):
            raise ValueError(f"purge_step must be an int >= 0 or None, got {purge_step!r}")
        self.path = Path(run_dir) / "tensorboard"
        self._writer = SummaryWriter(str(self.path), purge_step=purge_step)

    def write(self, m: dict) -> None:
        for tag, value in scalars(m).items():
            self._writer.add_scalar(tag, value, global_step=m["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
