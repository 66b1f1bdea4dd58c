"""Reasoning outputs (`--reasoning-parser`, gateway/reasoning.py) and `chat_template_kwargs`.

The splitter on its own (whole outputs and the same cut in arbitrary pieces, both parsers, with
and without a `<think>` the prompt left open, then composed with a tool-call parser), and through
a real gateway whose fake workers play a scripted output to the real `openai` client: the
message's `reasoning` / `reasoning_content`, the streamed deltas adding up to it, and
`chat_template_kwargs` reaching the template (Qwen3's `enable_thinking` switch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

from gateway.config import GatewayConfig, GatewayConfigError
from gateway.reasoning import ChatOutput, ReasoningSplitter, prompt_opens_reasoning
from gateway.tools import HermesOutput

# (parser, prompt left <think> open, output, reasoning, content)
CASES: list[tuple[str, bool, str, str | None, str]] = [
    ("qwen3", False, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    ("qwen3", False, "Paris, no thinking.", None, "Paris, no thinking."),
    ("qwen3", False, "  <thin is not a tag", None, "  <thin is not a tag"),
    ("qwen3", False, "<think>cut short while thi", "cut short while thi", ""),
    ("qwen3", True, "Thinking in the open block</think>Answer", "Thinking in the open block",
     "Answer"),
    ("qwen3", True, "", "", ""),
    ("deepseek_r1", False, "Step 1, step 2.\n</think>\n\n42", "Step 1, step 2.\n", "42"),
    ("deepseek_r1", False, "<think>Own tag.</think>  x < y </think>", "Own tag.",
     "x < y </think>"),
    ("deepseek_r1", False, "never closed </thi", "never closed </thi", ""),
]


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def _run(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str | None, str]:
    reasoning = content = ""
    for d in [*(splitter.feed(p) for p in pieces), splitter.finish()]:
        reasoning += d.reasoning
        content += d.content
    assert splitter.reasoning == (reasoning if splitter.entered else None)
    assert "".join(splitter.content_parts) == content
    return splitter.reasoning, content


@pytest.mark.parametrize(("parser", "opens", "text", "reasoning", "content"), CASES)
def test_whole(parser: str, opens: bool, text: str, reasoning: str | None, content: str) -> None:
    assert _run(ReasoningSplitter(parser, opens), [text]) == (reasoning, content)


@settings(max_examples=80, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_in_pieces_ends_where_whole_does(case: tuple[str, bool, str, str | None, str],
                                         cuts: list[int]) -> None:
    parser, opens, text, reasoning, content = case
    assert _run(ReasoningSplitter(parser, opens), _split(text, cuts)) == (reasoning, content)


def test_reasoning_streams_before_the_block_ends() -> None:
    s = ReasoningSplitter("qwen3", prompt_opens=False)
    assert not s.feed("<thi").reasoning            # a tag may be starting
    assert s.feed("nk>I am thinking").reasoning == "I am thinking"
    assert s.feed(" more</th").reasoning == " more"  # a possible end held back
    d = s.feed("ink>\n\nDone")
    assert (d.reasoning, d.content) == ("", "Done")


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning parser"):
        ReasoningSplitter("granite", prompt_opens=False)
    with pytest.raises(GatewayConfigError, match="reasoning_parser"):
        GatewayConfig(prefill_addresses=("127.0.0.1:1",), decode_addresses=("127.0.0.1:2",),
                      reasoning_parser="granite")


def test_prompt_left_open_is_read_from_its_tail() -> None:
    tok = smollm2_tokenizer()
    opened = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert prompt_opens_reasoning(tok, opened)
    assert not prompt_opens_reasoning(tok, closed)
    assert not prompt_opens_reasoning(tok, tok.encode("plain prompt", add_special_tokens=False))


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=10))
def test_reasoning_then_a_tool_call(cuts: list[int]) -> None:
    """The answer after the reasoning goes through the tool-call parser, streamed or whole."""
    text = ('<think>The user wants weather.</think>\n\nChecking.\n<tool_call>\n{"name": "w", '
            '"arguments": {"city": "Oslo"}}\n</tool_call>')
    for incremental in (False, True):
        out = ChatOutput(ReasoningSplitter("qwen3", False), HermesOutput(True, incremental))
        deltas = [*(out.feed(p) for p in _split(text, cuts)), out.finish()]
        assert "".join(d.reasoning for d in deltas) == "The user wants weather."
        assert "".join(d.content for d in deltas) == "Checking."
        args = "".join(c["function"].get("arguments", "") for d in deltas for c in d.calls)
        assert args == '{"city": "Oslo"}'
        message = out.message()
        assert message["reasoning"] == message["reasoning_content"] == "The user wants weather."
        assert message["content"] == "Checking." and message["tool_calls"][0]["function"] == {
            "name": "w", "arguments": '{"city": "Oslo"}'}


# -- through the gateway -------------------------------------------------------------------------
# A template that renders Qwen3's switch: thinking on, the answer starts inside an open block.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}")
SCRIPT = "Capital of France: Paris.\n</think>\n\nParis."
ASK = [{"role": "user", "content": "The capital of France?"}]


@pytest.fixture(scope="module")
def gw() -> Iterator[Harness]:
    ids = smollm2_tokenizer().encode(SCRIPT, add_special_tokens=False)
    with Harness(Script(ids), reasoning_parser="qwen3", chat_template=TEMPLATE) as h:
        yield h


def _client(gw: Harness) -> OpenAI:
    return OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0)


def test_message_carries_the_reasoning(gw: Harness) -> None:
    resp = _client(gw).chat.completions.create(model=MODEL_NAME, messages=ASK,  # type: ignore[arg-type]
                                               max_tokens=100)
    message: Any = resp.choices[0].message
    assert message.content == "Paris."
    assert message.reasoning == message.reasoning_content == "Capital of France: Paris.\n"
    assert resp.choices[0].finish_reason == "stop"


def test_stream_adds_up_to_the_message(gw: Harness) -> None:
    reasoning = content = ""
    chunks = 0
    for chunk in _client(gw).chat.completions.create(model=MODEL_NAME, messages=ASK,  # type: ignore[arg-type]
                                                     max_tokens=100, stream=True):
        if not chunk.choices:
            continue
        delta: Any = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        chunks += 1
    assert (reasoning, content) == ("Capital of France: Paris.\n", "Paris.")
    assert chunks > 4  # the reasoning came token by token, not at the end


def test_chat_template_kwargs_reach_the_template(gw: Harness) -> None:
    """`enable_thinking: false` closes the block in the prompt: the same output is then all
    content (the parser reads where the prompt left it), and /tokenize shows the prompt."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    resp = _client(gw).chat.completions.create(model=MODEL_NAME, messages=ASK,  # type: ignore[arg-type]
                                               max_tokens=100, extra_body=off)
    message: Any = resp.choices[0].message
    assert message.reasoning is None and message.content == SCRIPT
    tok = smollm2_tokenizer()
    for kwargs, tail in (({}, "<think>\n"), (off, "<think>\n\n</think>\n\n")):
        ids = httpx.post(f"{gw.base_url}/tokenize", json={"messages": ASK, **kwargs},
                         timeout=10).json()["tokens"]
        assert tok.decode(ids, skip_special_tokens=False).endswith("assistant\n" + tail)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"messages": []}, "set by the server"),
    ({"add_generation_prompt": False}, "set by the server"),
    ({"not a name": 1}, "not a template variable"),
    ({f"k{i}": i for i in range(33)}, "at most 32"),
    ([1, 2], "dictionary"),
])
def test_bad_chat_template_kwargs_are_refused(gw: Harness, kwargs: object, words: str) -> None:
    r = httpx.post(f"{gw.base_url}/v1/chat/completions", timeout=10, json={
        "model": MODEL_NAME, "messages": ASK, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("chat_template_kwargs") and words in error["message"]
