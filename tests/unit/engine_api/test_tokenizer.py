"""Tokenizer tests: the SmolLM2 GGUF vocabulary against transformers' GGUF tokenizer, chat
templates against transformers' apply_chat_template, tokenizer.json directories, torch-freedom."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.loader.load import default_model_path
from engine_api.chat_template import ChatTemplateError, render_chat_template
from engine_api.errors import ModelLoadError
from engine_api.tokenizer import Tokenizer

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
    code = ("import sys, engine_api.tokenizer, engine_api.detokenizer, engine_api.chat_template; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


# -- a SentencePiece vocabulary (llama.cpp's "llama": Llama 2, Mistral, TinyLlama, Phi-3) ---------
SPM_TEXTS = [t for t in TEXTS if "<|" not in t] + ["a</s>b <s> c", "Hello\nworld", "x  y"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A GGUF holding a SentencePiece BPE vocabulary trained here: <unk>, <s>, </s>, the 256 byte
    tokens, then the pieces, each scored by the rank of the merge that makes it (as
    SentencePiece scores them; single characters below every merge)."""
    import gguf
    import numpy as np
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    corpus = [t for t in TEXTS if t.strip()] * 3 + [
        "the quick brown fox jumps over the lazy dog " * 3, "hello world, hello there"]
    trainer.train_from_iterator(corpus, vocab_size=400, min_frequency=1, show_progress=False)
    model = json.loads(trainer._tokenizer.to_str())["model"]
    rank = {"".join(m.split(" ") if isinstance(m, str) else m): i
            for i, m in enumerate(model["merges"])}
    pieces = sorted((p for p in model["vocab"] if p != "<unk>"),  # the trainer's own <unk>
                    key=lambda p: rank.get(p, len(rank) + model["vocab"][p]))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(rank.get(p, len(rank) + model["vocab"][p])) for p in pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    # A tiny random Llama around it, so that an engine can load the file (F32, 1 layer).
    hidden, ff, vocab = 32, 64, len(tokens)
    for key, value in (("block_count", 1), ("context_length", 128), ("embedding_length", hidden),
                       ("feed_forward_length", ff), ("head_count", 2), ("head_count_kv", 2)):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "output.weight": (vocab, hidden), "blk.0.attn_norm.weight": (hidden,),
              "blk.0.ffn_norm.weight": (hidden,), "blk.0.attn_q.weight": (hidden, hidden),
              "blk.0.attn_k.weight": (hidden, hidden), "blk.0.attn_v.weight": (hidden, hidden),
              "blk.0.attn_output.weight": (hidden, hidden), "blk.0.ffn_gate.weight": (ff, hidden),
              "blk.0.ffn_up.weight": (ff, hidden), "blk.0.ffn_down.weight": (hidden, ff)}
    for name, shape in shapes.items():
        w.add_tensor(name, (np.ones(shape) if "norm" in name
                            else rng.normal(0, 0.2, shape)).astype(np.float32))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_sentencepiece_gguf_matches_transformers(spm_gguf: str) -> None:
    """The pipeline rebuilt from a SentencePiece GGUF tokenizes and decodes as `transformers`
    does from the same file: spaces as "▁" (one before the text), merges by score, bytes of
    characters without a piece as <0xXX> tokens, <s> / </s> as control tokens, BOS first."""
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(spm_gguf)
    folder, filename = os.path.split(spm_gguf)
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    merged = 0
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ids[:1] == [1]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), text
        merged += sum(len(t) > 2 and not t.startswith("<0x") for t in
                      ref.convert_ids_to_tokens(ids))
    assert merged > 20  # the vocabulary's merges were used, not characters and bytes alone
    unseen = ours.encode("✓", add_special_tokens=False)  # no piece holds it: its three bytes
    assert ours.convert_ids_to_tokens(unseen)[-3:] == ["<0xE2>", "<0x9C>", "<0x93>"]
    assert ours.decode(unseen) == "✓"


def test_an_engine_runs_on_a_sentencepiece_gguf(spm_gguf: str) -> None:
    """The engine loads the file (weights and vocabulary), streams text, and a structured-output
    constraint compiles against the SentencePiece vocabulary and holds (random weights)."""
    from engine import LLM, SamplingParams
    from engine_api.sampling_params import StructuredOutputs

    llm = LLM(spm_gguf, device="cpu", max_model_len=128, num_gpu_blocks=32)
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [out] = llm.generate("hello world", free)
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].text == llm.engine.tokenizer.decode(out.outputs[0].token_ids)  # type: ignore[union-attr]
    digits = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputs(regex=r"[0-9]{2} ok"))
    [out] = llm.generate("hello world", digits)
    assert out.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{2} ok", out.outputs[0].text), out.outputs[0].text
