"""Generation settings a checkpoint directory carries: the EOS token ids.

Chat models often list several EOS ids in ``generation_config.json`` (end of turn, end of
text); ``config.json`` may name one. They stop generation unless a request sets ``ignore_eos``.
"""

from __future__ import annotations

import json
from pathlib import Path


def eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (preferred) or ``config.json``; empty if neither
    names one."""
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if not file.is_file():
            continue
        eos = json.loads(file.read_text()).get("eos_token_id")
        if eos is None:
            continue
        ids = (eos,) if isinstance(eos, int) else tuple(eos)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, got {eos!r}")
        return ids
    return ()
