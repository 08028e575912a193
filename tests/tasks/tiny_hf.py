"""A tiny Hugging Face model directory made locally, no downloads: the suite's tiny MoE saved
as a checkpoint, beside a character-level tokenizer built with the `tokenizers` library, its
``tokenizer_config.json`` (special tokens, a Qwen-style chat template) and a
``generation_config.json`` naming the stop tokens.

Every character of ``CHARS`` is one token; ``SPECIALS`` come first (ids 0-5). ``encode`` adds
``<bos>`` in front (the post-processor), as many tokenizers do.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import qat_model, tiny_config, tiny_precision

from fp4rl.model.checkpoint import save_checkpoint

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>")
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=?.,:\\{}$\n"
BOS, EOS, IM_END = 1, 2, 5
VOCAB_SIZE = len(SPECIALS) + len(CHARS)  # 57

# Block tags on lines of their own: trim_blocks / lstrip_blocks decide the whitespace, so the
# rendering matches transformers' only if the Jinja environment does.
CHAT_TEMPLATE = """{{ bos_token }}
{% if messages[0]['role'] != 'system' %}
<|im_start|>system
be brief<|im_end|>
{% endif %}
{% for message in messages %}
    <|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate((*SPECIALS, *CHARS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIALS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    return tokenizer


def save_tokenizer(path: Path, *, chat_template: str | None = CHAT_TEMPLATE, eos_ids=(EOS,)):
    """Write the tokenizer files into the existing directory ``path``."""
    build_tokenizer().save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    # An added-token object, as transformers writes special_tokens_map.json.
    eos = {"content": "<|im_end|>", "lstrip": False, "normalized": False, "special": True}
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos}))
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if eos_ids is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos_ids)}))


def model_dir(path: Path, **tokenizer) -> Path:
    """The tiny MoE (vocabulary 128) saved to the new directory ``path``, with the tokenizer."""
    precision = tiny_precision()
    model = qat_model(precision, config=tiny_config())
    save_checkpoint(model.state_dict(), model.config, path)
    save_tokenizer(path, **tokenizer)
    return path
