"""Prompt tokenisation through the Rust tokenizer (``prompts.encode``): the same ids as
``tokenizer.encode`` whenever it takes that path, and transformers' own path whenever the
tokenizer or its backend's state could make them differ."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from onecat.runtime.server.prompts import chat_token_ids, encode, plain_backend, text_token_ids
from onecat.tiny_train import fixture_dir

TEXTS = [
    "Hello world",
    "",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "émoji 🤖 中文 ＡＢＣ \u200b zero-width",
    "def f(x):\n    return x ** 2  # code\n" * 20,
]


@pytest.fixture
def tokenizer():
    return AutoTokenizer.from_pretrained(fixture_dir("qwen3_5"))


def test_the_fast_path_gives_transformers_ids(tokenizer):
    assert plain_backend(tokenizer) is not None
    for text in TEXTS:
        for special in (True, False):
            assert encode(tokenizer, text, special) == list(tokenizer.encode(text, add_special_tokens=special))
    messages = [{"role": "user", "content": TEXTS[4]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat_token_ids(tokenizer, messages) == list(tokenizer.encode(rendered, add_special_tokens=False))


def test_split_special_tokens_is_honoured(tokenizer):
    tokenizer.split_special_tokens = True
    assert plain_backend(tokenizer) is None  # the backend still matches special tokens whole
    text = "<|im_end|> and <|endoftext|>"
    expected = list(tokenizer.encode(text, add_special_tokens=False))  # transformers syncs the backend
    assert len(expected) > 2 and tokenizer.convert_tokens_to_ids("<|im_end|>") not in expected
    assert plain_backend(tokenizer) is not None
    assert text_token_ids(tokenizer, text, add_special_tokens=False) == expected


def test_truncation_left_on_the_backend_is_not_inherited(tokenizer):
    text = TEXTS[5]
    full = list(tokenizer.encode(text))
    tokenizer.backend_tokenizer.enable_truncation(8)
    assert plain_backend(tokenizer) is None
    assert text_token_ids(tokenizer, text) == full  # transformers' path, which also clears it
    assert plain_backend(tokenizer) is not None and text_token_ids(tokenizer, text) == full


def test_a_tokenizer_class_with_its_own_encoding_keeps_it(tokenizer):
    class Custom(type(tokenizer)):
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    tokenizer.__class__ = Custom
    assert plain_backend(tokenizer) is None
    assert text_token_ids(tokenizer, "Hello world") == list(tokenizer.encode("Hello world"))
