"""A Hugging Face tokenizer and chat template read from a local model directory.

The tokenizer is the directory's ``tokenizer.json`` through the `tokenizers` library (the
Rust tokenizer that transformers' fast tokenizers wrap); a directory without one (only
``vocab.json`` + ``merges.txt`` or a SentencePiece model) is converted by transformers' fast
tokenizer when transformers is installed. Special tokens come from ``special_tokens_map.json``
and ``tokenizer_config.json``; the stop tokens are ``generation_config.json``'s
``eos_token_id`` together with the tokenizer's ``eos_token``. The chat template is
``chat_template.jinja`` or else ``tokenizer_config.json``'s ``chat_template``, rendered the way
transformers renders it (a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now`` and a ``tojson`` that
does not escape HTML), with the special tokens' text in scope.

Owns reading those files and text <-> ids. Does not own what a prompt says
(`fp4rl.tasks.jsonl`) or the model's vocabulary. Needs ``pip install 'fp4rl[hf]'``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class HfTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        self.path = Path(model_dir)
        if not self.path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {self.path} does not exist")
        self._tokenizer = _backend(self.path)
        self.special_tokens = _special_tokens(self.path)  # e.g. {"eos_token": "<|im_end|>"}
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1  # ids run from 0; a gap still needs a row
        self.stop_token_ids = self._stop_token_ids()
        self.chat_template = _chat_template(self.path)  # None when the directory has none

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor
        (e.g. a leading BOS), as transformers does by default."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt=True) -> str:
        """The template's text for ``messages`` (``[{"role": ..., "content": ...}, ...]``),
        ending with the assistant's turn opened when ``add_generation_prompt``. Its ids are
        ``encode(text, add_special_tokens=False)``: the template writes the special tokens."""
        if self.chat_template is None:
            raise ValueError(
                f"{self.path} has no chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json)"
            )
        import jinja2

        try:
            return _compile(self.chat_template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(
                f"the chat template of {self.path} is not valid Jinja: {err}"
            ) from None
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat template of {self.path} failed: {err}") from None

    def _stop_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        generation = _read_json(self.path / "generation_config.json")
        eos_id = generation.get("eos_token_id")
        for i in eos_id if isinstance(eos_id, list) else [eos_id]:
            if i is None:
                continue
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"{self.path / 'generation_config.json'}: eos_token_id {i!r} is not a token "
                    f"id in [0, {self.vocab_size})"
                )
            ids.append(i)
        eos = self.special_tokens.get("eos_token")
        if eos is not None:
            i = self._tokenizer.token_to_id(eos)
            if i is None:
                raise ValueError(f"{self.path}: eos_token {eos!r} is not in the vocabulary")
            ids.append(i)
        if not ids:
            raise ValueError(
                f"{self.path}: no end-of-sequence token: neither generation_config.json's "
                "eos_token_id nor tokenizer_config.json's eos_token names one"
            )
        return tuple(dict.fromkeys(ids))


def _backend(path: Path):
    """The `tokenizers.Tokenizer` of the directory."""
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "reading a Hugging Face tokenizer needs the tokenizers library: pip install 'fp4rl[hf]'"
        ) from None
    file = path / "tokenizer.json"
    if file.exists():
        try:
            return tokenizers.Tokenizer.from_file(str(file))
        except Exception as err:  # the Rust library raises its own exception type
            raise ValueError(
                f"{file}: not a tokenizer the tokenizers library reads: {err}"
            ) from None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise FileNotFoundError(
            f"{path} has no tokenizer.json; install transformers to convert its tokenizer "
            "files, or save the tokenizer with a tokenizer.json"
        ) from None
    try:
        fast = AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True)
    except Exception as err:  # transformers raises many types for unreadable directories
        raise ValueError(f"{path}: transformers could not load a tokenizer: {err}") from None
    if not getattr(fast, "is_fast", False):
        raise ValueError(f"{path}: transformers found no fast tokenizer for these files")
    return fast.backend_tokenizer


def _read_json(file: Path) -> dict:
    if not file.exists():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(data).__name__}")
    return data


def _special_tokens(path: Path) -> dict[str, str]:
    """The special tokens' text; ``tokenizer_config.json`` wins over ``special_tokens_map.json``.
    A token is written as a string or as an added-token object with a ``content``."""
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        data = _read_json(path / name)
        for key in SPECIAL_KEYS:
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
            elif value is not None:
                raise ValueError(f"{path / name}: {key} must be a string, got {value!r}")
    return out


def _chat_template(path: Path) -> str | None:
    file = path / "chat_template.jinja"
    if file.exists():
        return file.read_text(encoding="utf-8")
    template = _read_json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise ValueError(
                f"{path / 'tokenizer_config.json'}: chat_template lists {sorted(named)} but no "
                "'default'"
            )
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template must be a string")
    return template


def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
