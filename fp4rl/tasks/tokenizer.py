"""A character-level tokenizer for the built-in arithmetic task: one id per character.

Owns the vocabulary and the text <-> id mapping. Does not own what a prompt or an answer looks
like (`fp4rl.tasks.arith`), nor how the model pads its vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789+="
VOCAB = SPECIALS + tuple(CHARS)  # 15 ids; the model may round its vocabulary up to 16
_ID = {c: i for i, c in enumerate(VOCAB) if i >= len(SPECIALS)}


def encode(text: str) -> list[int]:
    """Ids of the characters of ``text``; special tokens are never parsed from text."""
    ids = []
    for position, char in enumerate(text):
        if char not in _ID:
            raise ValueError(f"character {char!r} at {position} of {text!r} is not in {CHARS!r}")
        ids.append(_ID[char])
    return ids


def decode(ids: Iterable[int]) -> str:
    """Text of ``ids``, special tokens written as ``<pad>``, ``<bos>``, ``<eos>``."""
    out = []
    for i in ids:
        if not 0 <= i < len(VOCAB):
            raise ValueError(f"token id {i} is outside the vocabulary [0, {len(VOCAB)})")
        out.append(VOCAB[i])
    return "".join(out)
