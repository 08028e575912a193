"""A Hugging Face tokenizer and chat template from a local directory: ids and text as
transformers gives them, stop tokens from the directory's files, errors naming the file."""

import json
import sys

import pytest
from tiny_hf import BOS, EOS, IM_END, VOCAB_SIZE, save_tokenizer

from fp4rl.tasks.hf_tokenizer import HfTokenizer

pytest.importorskip("tokenizers")

MESSAGES = [{"role": "user", "content": "what is 2+3? "}]


def test_ids_text_and_stop_tokens(tmp_path):
    save_tokenizer(tmp_path)
    tokenizer = HfTokenizer(tmp_path)
    assert tokenizer.vocab_size == VOCAB_SIZE
    # generation_config.json's eos_token_id, then the tokenizer's eos_token, once each
    assert tokenizer.stop_token_ids == (EOS, IM_END)
    ids = tokenizer.encode("2+3=5")
    assert ids[0] == BOS and len(ids) == 6  # the post-processor's <bos>, one id per character
    assert tokenizer.encode("2+3=5", add_special_tokens=False) == ids[1:]
    assert tokenizer.decode([*ids, IM_END]) == "2+3=5"  # special tokens left out
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>2+3=5"


def test_chat_template_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    save_tokenizer(tmp_path)
    ours = HfTokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for messages in (MESSAGES, [{"role": "system", "content": "x"}, *MESSAGES]):
        for generation_prompt in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
            assert text == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            expected = theirs.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=generation_prompt
            )
            expected = expected if isinstance(expected, list) else expected["input_ids"]
            assert ours.encode(text, add_special_tokens=False) == list(expected)
    # trim_blocks drops the newline after each block tag, lstrip_blocks the spaces before one
    assert text == (
        "<bos>\n    <|im_start|>system\nx<|im_end|>\n    <|im_start|>user\nwhat is 2+3?<|im_end|>\n"
    )


def test_chat_template_file_wins_over_tokenizer_config(tmp_path):
    save_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert HfTokenizer(tmp_path).apply_chat_template(MESSAGES) == "what is 2+3? !"


def test_stop_tokens_from_the_tokenizer_alone(tmp_path):
    save_tokenizer(tmp_path, eos_ids=None)
    assert HfTokenizer(tmp_path).stop_token_ids == (IM_END,)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 99})),
            r"generation_config.json: eos_token_id 99 is not a token id in \[0, 57\)",
        ),
        (
            lambda d: (d / "special_tokens_map.json").write_text('{"eos_token": "<end>"}'),
            r"eos_token '<end>' is not in the vocabulary",
        ),
        (
            lambda d: (d / "tokenizer_config.json").write_text("{"),
            r"tokenizer_config.json: not valid JSON",
        ),
        (
            lambda d: (d / "tokenizer.json").write_text("{}"),
            r"tokenizer.json: not a tokenizer the tokenizers library reads",
        ),
    ],
)
def test_bad_files_are_named(tmp_path, edit, message):
    save_tokenizer(tmp_path)
    edit(tmp_path)
    with pytest.raises(ValueError, match=message):
        HfTokenizer(tmp_path)


def test_no_stop_token_and_no_template_are_errors(tmp_path):
    save_tokenizer(tmp_path, eos_ids=None, chat_template=None)
    (tmp_path / "special_tokens_map.json").unlink()
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        HfTokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2]}')
    tokenizer = HfTokenizer(tmp_path)
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizer.apply_chat_template(MESSAGES)


def test_a_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory .*nowhere does not exist"):
        HfTokenizer(tmp_path / "nowhere")


def test_template_errors_name_the_directory(tmp_path):
    save_tokenizer(tmp_path, chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match=r"chat template of .* failed: only user turns"):
        HfTokenizer(tmp_path).apply_chat_template(MESSAGES)
    save_tokenizer(tmp_path, chat_template="{% if %}")
    with pytest.raises(ValueError, match=r"chat template of .* is not valid Jinja"):
        HfTokenizer(tmp_path).apply_chat_template(MESSAGES)


def byte_level_bpe_files(path):
    """A GPT-2 style tokenizer saved the older way: vocab.json and merges.txt, no
    tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    text = ["what is 2+3? the answer is 5"] * 10
    bpe.train_from_iterator(text, vocab_size=300, min_frequency=1, special_tokens=["<|eot|>"])
    bpe.save_model(str(path))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|eot|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return bpe


def test_without_tokenizer_json_transformers_converts_the_files(tmp_path):
    pytest.importorskip("transformers")
    bpe = byte_level_bpe_files(tmp_path)
    tokenizer = HfTokenizer(tmp_path)
    text = "what is 2+3?"
    assert tokenizer.encode(text) == bpe.encode(text).ids
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.stop_token_ids == (bpe.token_to_id("<|eot|>"),)


def test_without_tokenizer_json_or_transformers_the_cause_is_named(tmp_path, monkeypatch):
    byte_level_bpe_files(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json; install transformers"):
        HfTokenizer(tmp_path)
