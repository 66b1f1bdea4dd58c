"""IncrementalDetokenizer: streamed text equals whole-sequence decode, never partial UTF-8,
stop strings caught across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.loader.load import default_model_path
from engine_api.detokenizer import IncrementalDetokenizer
from engine_api.tokenizer import Tokenizer

MULTILINGUAL = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café naïve Straße — “quotes” … ¿qué? ¡sí!",
    "日本語のテキストと中文字符，还有한국어 문장。",
    "Emoji 🤗🚀👍🏽 and a family 👨‍👩‍👧‍👦 plus flags 🇫🇷🇯🇵 ✨",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم",
    "code:\n\tdef f(x):\n\t    return {'a': [1, 2, 3]}\n",
]


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255) plus special id 256 = "<eos>": the worst case for
    multi-byte characters, with an exact, obvious decode."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i == 256:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                if not skip_special_tokens:
                    out.append("<eos>")
            else:
                buf.append(i)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    deltas = []
    for i in range(0, len(ids), chunk):
        res = detok.add_tokens(ids[i:i + chunk])
        deltas.append(res.text_delta)
        if res.stop_matched is not None:
            break
    else:
        deltas.append(detok.finish().text_delta)
    return deltas


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(default_model_path())


@pytest.mark.parametrize("text", MULTILINGUAL)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    prompt = tok.encode("<|im_start|>user\nSay something<|im_end|>\n")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(detok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.output_text == text
    assert all("\ufffd" not in d for d in deltas)
    # emoji and CJK really are split across tokens in this vocabulary: the test is not vacuous
    if "🤗" in text:
        assert any(tok.decode([i]).endswith("\ufffd") for i in ids)


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi there<|im_end|>\n<|im_start|>again")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(_stream(detok, ids)) == tok.decode(ids) == "Hi there\nagain"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(_stream(detok, ids)) == "Hi there<|im_end|>\n<|im_start|>again"


def test_stop_string_across_tokens(tok: Tokenizer) -> None:
    text = "The answer is forty-two. END OF STORY and more text"
    ids = tok.encode(text)
    stop = "wo. END"
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces), "stop must span several tokens"
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    deltas, matched = [], None
    for n, i in enumerate(ids):  # noqa: B007 (n is read after the loop)
        res = detok.add_tokens([i])
        deltas.append(res.text_delta)
        if res.stop_matched:
            matched = res.stop_matched
            break
        assert not "".join(deltas).endswith("w"), "a stop-string prefix must be held back"
    assert matched == stop and detok.finished
    assert "".join(deltas) == detok.output_text == "The answer is forty-t"
    assert tok.decode(ids[: n + 1]).startswith("The answer is forty-two. END")
    assert detok.add_tokens([ids[-1]]).text_delta == ""  # nothing after the stop

    detok = IncrementalDetokenizer(tok, [], stop=["zzz", stop], include_stop_str_in_output=True)
    _stream(detok, ids)
    assert detok.output_text == "The answer is forty-two. END"


def test_held_prefix_released_when_no_match(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma")
    detok = IncrementalDetokenizer(tok, [], stop=["gamma ray"])
    streamed = "".join(detok.add_tokens([i]).text_delta for i in ids)
    assert streamed == "alpha beta "  # "gamma" may still become "gamma ray"
    assert detok.finish().text_delta == "gamma"
    assert detok.output_text == "alpha beta gamma"


def test_earliest_stop_wins() -> None:
    ids = list(b"xx STOP yy END")
    detok = IncrementalDetokenizer(ByteTokenizer(), [], stop=["END", "STOP"])
    deltas = _stream(detok, ids, chunk=len(ids))
    assert "".join(deltas) == "xx " and detok.output_text == "xx "


def test_no_partial_utf8_byte_tokens() -> None:
    text = "é🤗中"
    ids = list(text.encode())
    detok = IncrementalDetokenizer(ByteTokenizer(), list(b"ab"))
    deltas = [detok.add_tokens([i]).text_delta for i in ids]
    assert [d for d in deltas if d] == ["é", "🤗", "中"]


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=0, max_size=40), chunk=st.integers(1, 7),
       stop=st.text(min_size=1, max_size=4), include=st.booleans())
def test_property_byte_tokens(text: str, chunk: int, stop: str, include: bool) -> None:
    ids = list(text.encode())
    detok = IncrementalDetokenizer(ByteTokenizer(), [], stop=[stop],
                                   include_stop_str_in_output=include)
    deltas = _stream(detok, ids, chunk)
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)
    i = text.find(stop)
    expected = text if i < 0 else text[: i + (len(stop) if include else 0)]
    assert "".join(deltas) == detok.output_text == expected
