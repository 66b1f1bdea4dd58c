"""Tokenizer tests: the SmolLM2 GGUF vocabulary against transformers' GGUF tokenizer, chat
templates against transformers' apply_chat_template, tokenizer.json directories, torch-freedom."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.chat_template import ChatTemplateError, render_chat_template
from engine.loader.errors import ModelLoadError
from engine.loader.load import default_model_path
from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces,   runs of spaces\n\n\n\ttabs and\r\nCRLF ",
    "numbers 12345 3.14159 -42 1e10 0x1F",
    "emoji 🤗🚀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<repo_name>c",
    "Ünïcödé naïve café Straße",
    "ΑΒΓ δ Привет мир こんにちは世界 مرحبا بالعالم 안녕하세요",
    "I'm sure you'll see they've DONE it, isn't it?",
    "",
    "   ",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be kind."},
     {"role": "user", "content": "Tell me a joke."},
     {"role": "assistant", "content": "Why did the 🐔 cross the road?"},
     {"role": "user", "content": "Why?\nTell me."}],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def tok(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_file(gguf_path)


@pytest.fixture(scope="module")
def ref(gguf_path: str) -> Any:
    from transformers import AutoTokenizer

    folder, filename = os.path.split(gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=filename)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, ref: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.encode("<|im_start|>") == [1]  # never split
    assert tok.convert_ids_to_tokens([1, 2, 0]) == ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, ref: Any, conv: list[dict[str, str]],
                                            add_generation_prompt: bool) -> None:
    want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt) == want
    ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ref.encode(want, add_special_tokens=False)


CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if loop.index0 > 5 %}{% break %}{% endif %}"
    "{{ m['role'] }}: {{ m | tojson }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}{{ eos_token }}"
)


def test_custom_template_semantics_match_transformers(tok: Tokenizer, ref: Any) -> None:
    # tojson keeps non-ASCII and <, >, & unescaped (transformers' filter, not jinja's)
    conv = [{"role": "user", "content": "héllo <b> & 'q' 🤗"}]
    want = ref.apply_chat_template(conv, chat_template=CUSTOM_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True)
    got = render_chat_template(CUSTOM_TEMPLATE, conv, True,
                               {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    assert got == want
    assert '"héllo <b> & \'q\' 🤗"' in got
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        render_chat_template(CUSTOM_TEMPLATE, [{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("messages, field", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]\.role"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
    (["hi"], r"messages\[0\]"),
])
def test_bad_messages(tok: Tokenizer, messages: Any, field: str) -> None:
    with pytest.raises(ChatTemplateError, match=field):
        tok.apply_chat_template(messages)


def test_template_syntax_error() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "x"}])


def test_tokenizer_json_dir(tok: Tokenizer, tmp_path: Path) -> None:
    """A HF directory: tokenizer.json + tokenizer_config.json (add_bos_token, named templates)."""
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    templates = [{"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
                 {"name": "rag", "template": "R"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>", "chat_template": templates}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_file(str(tmp_path))
    assert hf.bos_token_id == 1 and hf.eos_token_ids == (2, 0)
    assert hf.encode("Hello") == [1, *tok.encode("Hello")]
    assert hf.encode("Hello", add_special_tokens=False) == tok.encode("Hello")
    assert hf.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
    assert hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True) == [
        1, *tok.encode("x")]


def test_missing_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nothing"):
        Tokenizer.from_file(str(tmp_path / "nothing.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_file(str(bad))
    bad_gguf = tmp_path / "x.gguf"
    bad_gguf.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match=r"x\.gguf"):
        Tokenizer.from_file(str(bad_gguf))


def test_import_is_torch_free() -> None:
    code = ("import sys, engine.tokenizer, engine.detokenizer, engine.chat_template; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)
