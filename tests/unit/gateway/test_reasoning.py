"""Reasoning outputs (`--reasoning-parser`, gateway/reasoning.py) and `chat_template_kwargs`.

The splitter on its own (whole outputs and the same cut in arbitrary pieces, both parsers, with
and without a `<think>` the prompt left open, then composed with a tool-call parser), and through
a real gateway whose fake workers play a scripted output to the real `openai` client: the
message's `reasoning` / `reasoning_content`, the streamed deltas adding up to it, and
`chat_template_kwargs` reaching the template (Qwen3's `enable_thinking` switch). Over gRPC
(`Gateway.Generate` on the same gateway): `reasoning` and `text` deltas joining into REST's
message, the template variables as a Struct, checked as REST's, and reasoning with a tool call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

from gateway.config import GatewayConfig, GatewayConfigError
from gateway.grpc_tools import template_kwargs_from_proto
from gateway.reasoning import ChatOutput, ReasoningSplitter, prompt_reasoning
from gateway.tool_parsers import HermesOutput
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer

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


def test_where_the_prompt_leaves_reasoning_is_read_from_its_tail() -> None:
    tok = smollm2_tokenizer()

    def where(text: str) -> str | None:
        return prompt_reasoning(tok, tok.encode(text, add_special_tokens=False))

    assert where("<|im_start|>assistant\n<think>\n") == "open"
    assert where("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"
    assert where("plain prompt") is None
    # An earlier turn's block is not this turn's: the prompt must end with the closing tag.
    assert where("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n") is None
    assert where("x " * 100 + "<think>\n") == "open"  # only the tail is read


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
    # reasoning_tokens: the output's first k tokens, the fewest whose text holds </think>.
    assert resp.usage is not None and resp.usage.completion_tokens_details is not None
    k = resp.usage.completion_tokens_details.reasoning_tokens
    assert k is not None
    tok = smollm2_tokenizer()
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    assert 0 < k < len(ids) == resp.usage.completion_tokens
    assert "</think>" in tok.decode(ids[:k]) and "</think>" not in tok.decode(ids[:k - 1])
    off = _client(gw).chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=100,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage is not None and off.usage.completion_tokens_details is not None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    cut = _client(gw).chat.completions.create(model=MODEL_NAME, messages=ASK,  # type: ignore[arg-type]
                                              max_tokens=3)  # cut short while thinking
    assert cut.usage is not None and cut.usage.completion_tokens_details is not None
    assert cut.usage.completion_tokens_details.reasoning_tokens == 3


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
    # /tokenizer_info shows the template chat requests use: the gateway's --chat-template.
    assert httpx.get(f"{gw.base_url}/tokenizer_info", timeout=10).json()["chat_template"] == TEMPLATE
    for kwargs, tail in (({}, "<think>\n"), (off, "<think>\n\n</think>\n\n")):
        ids = httpx.post(f"{gw.base_url}/tokenize", json={"messages": ASK, **kwargs},
                         timeout=10).json()["tokens"]
        assert tok.decode(ids, skip_special_tokens=False).endswith("assistant\n" + tail)


def test_a_constrained_output_is_all_content(gw: Harness) -> None:
    """Where the tags are not one token each (SmolLM2's vocabulary), the engine cannot see where
    the reasoning ends: the constraint holds from the first token, so the model does not think,
    and with the prompt's <think> left open the output is still content (the fake workers play
    the script whatever the constraint)."""
    resp = _client(gw).chat.completions.create(model=MODEL_NAME, messages=ASK,  # type: ignore[arg-type]
                                               max_tokens=100,
                                               response_format={"type": "json_object"})
    message: Any = resp.choices[0].message
    assert getattr(message, "reasoning", None) is None and message.content == SCRIPT
    sent = gw.prefill[0].prefill_requests[-1].sampling.structured_outputs
    assert sent.json_object and not sent.HasField("reasoning_end_token_id")


# -- a vocabulary with <think> and </think> as tokens (Qwen3's, DeepSeek-R1's) -------------------
def thinking_tokenizer() -> Any:
    """SmolLM2's tokenizer with `<think>` and `</think>` added as single tokens, as Qwen3 has them
    (added, not special: they stay in decoded text)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as BackendTokenizer

    base = smollm2_tokenizer()
    backend = BackendTokenizer.from_str(base.backend.to_str())  # type: ignore[attr-defined]
    backend.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return dataclasses.replace(base, backend=backend)  # type: ignore[type-var]


# Thinking on (the prompt opens the block), off (it closes one), or left to the model (no tag).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% elif not (model_opens is defined and model_opens) %}<think>\n"
    "{% endif %}")
ANSWER = '{"capital": "Paris"}'


@pytest.fixture(scope="module")
def thinking_gw() -> Iterator[Harness]:
    tok = thinking_tokenizer()
    ids = tok.encode("The capital is Paris.</think>" + ANSWER, add_special_tokens=False)
    with Harness(Script(ids), tokenizer=tok, reasoning_parser="qwen3",
                 chat_template=THINKING_TEMPLATE) as h:
        yield h


@pytest.mark.parametrize(("kwargs", "gate"), [
    ({}, ("</think>", None)),                                # reasons from the first token
    ({"model_opens": True}, ("</think>", "<think>")),        # reasons if it writes <think>
    ({"enable_thinking": False}, None),                      # the language from the first token
])
def test_a_constrained_answer_follows_the_reasoning(thinking_gw: Harness, kwargs: dict[str, Any],
                                                    gate: tuple[str, str | None] | None) -> None:
    """With one token for each tag, a constrained chat output reasons first and is in the
    language after `</think>` (vLLM's reasoning-aware structured outputs): the gateway tells
    the workers which token ends the reasoning (and which may open it, when the prompt left
    that to the model), reading where the prompt left it as the parser does."""
    tok = thinking_gw.tokenizer
    resp = _client(thinking_gw).chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=100,  # type: ignore[arg-type]
        response_format={"type": "json_object"}, extra_body={"chat_template_kwargs": kwargs})
    message: Any = resp.choices[0].message
    sent = thinking_gw.prefill[0].prefill_requests[-1].sampling.structured_outputs
    assert sent.json_object
    if gate is None:
        assert not sent.HasField("reasoning_end_token_id")
        assert not sent.HasField("reasoning_start_token_id")
        assert getattr(message, "reasoning", None) is None
        return
    end, start = (tok.encode(t, add_special_tokens=False) if t else None for t in gate)
    assert end == [sent.reasoning_end_token_id]
    assert (start is None) == (not sent.HasField("reasoning_start_token_id"))
    assert start is None or start == [sent.reasoning_start_token_id]
    if start is None:  # the script's reasoning has no <think>: with the model to open it, content
        assert message.reasoning == "The capital is Paris." and message.content == ANSWER
        assert json.loads(message.content) == {"capital": "Paris"}


def test_a_tool_choice_follows_the_reasoning_over_grpc(thinking_gw: Harness) -> None:
    """gRPC's chat goes the same way, and so does a named tool choice (a constraint too)."""
    tool = gateway_pb2.Tool(name="capital", parameters=json.dumps(
        {"type": "object", "properties": {"capital": {"type": "string"}}}))
    out = _grpc(thinking_gw, **GRPC_ASK, tools=[tool],
                tool_choice=gateway_pb2.ToolChoice(function_name="capital"))
    sent = thinking_gw.prefill[0].prefill_requests[-1].sampling.structured_outputs
    assert sent.json_schema and [sent.reasoning_end_token_id] == thinking_gw.tokenizer.encode(
        "</think>", add_special_tokens=False)
    chunks = _chunks(out)
    assert "".join(c.reasoning for c in chunks) == "The capital is Paris."
    calls = [call for c in chunks for call in c.tool_calls]
    assert calls and calls[0].name == "capital"
    assert json.loads("".join(call.arguments for call in calls)) == {"capital": "Paris"}


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"messages": []}, "set by the server"),
    ({"add_generation_prompt": False}, "set by the server"),
    ({"tokenize": True}, "set by the server"),
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


# -- over gRPC (Gateway.Generate) --------------------------------------------------------------
def _grpc(gw: Harness, **fields: Any) -> list[gateway_pb2.GenerateResponse]:
    with grpc.insecure_channel(gw.grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return list(stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=20))


def _chat(messages: list[dict[str, str]]) -> gateway_pb2.ChatMessages:
    return gateway_pb2.ChatMessages(messages=[
        gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages])


def _kwargs(value: dict[str, Any]) -> struct_pb2.Struct:
    kwargs = struct_pb2.Struct()
    kwargs.update(value)
    return kwargs


def _chunks(out: list[gateway_pb2.GenerateResponse]) -> list[gateway_pb2.GenerateChunk]:
    return [r.chunk for r in out if r.WhichOneof("response") == "chunk"]


GRPC_ASK = {"chat": _chat(ASK), "sampling": common_pb2.SamplingParams(max_tokens=100)}


def test_grpc_deltas_add_up_to_the_rest_message(gw: Harness) -> None:
    """The same request over both front doors: gRPC's `reasoning` and `text` deltas join into
    REST's message, streamed as the tokens come; the token ids stay the model's."""
    resp: Any = _client(gw).chat.completions.create(model=MODEL_NAME, messages=ASK,  # type: ignore[arg-type]
                                                    max_tokens=100)
    rest = resp.choices[0].message
    out = _grpc(gw, **GRPC_ASK)
    chunks = _chunks(out)
    assert "".join(c.reasoning for c in chunks) == rest.reasoning == "Capital of France: Paris.\n"
    assert "".join(c.text for c in chunks) == rest.content == "Paris."
    assert [t for c in chunks for t in c.token_ids] == gw.script.token_ids
    assert sum(bool(c.reasoning) for c in chunks) > 4  # token by token, not at the end
    assert not any(c.reasoning and c.text for c in chunks)  # "</think>" itself is neither
    assert out[-1].complete.finish_reason == common_pb2.FINISH_REASON_STOP
    usage = out[-1].complete.usage
    assert usage.reasoning_tokens == resp.usage.completion_tokens_details.reasoning_tokens > 0
    plain = _grpc(gw, **GRPC_ASK, chat_template_kwargs=_kwargs({"enable_thinking": False}))
    assert plain[-1].complete.usage.reasoning_tokens == 0


def test_grpc_chat_template_kwargs_reach_the_template(gw: Harness) -> None:
    """`enable_thinking: false` closes the block in the prompt: the same output is all content."""
    out = _grpc(gw, **GRPC_ASK, chat_template_kwargs=_kwargs({"enable_thinking": False}))
    chunks = _chunks(out)
    assert "".join(c.text for c in chunks) == SCRIPT
    assert not any(c.reasoning for c in chunks)
    prompt = gw.prefill[0].prefill_requests[-1].prompt_token_ids
    assert smollm2_tokenizer().decode(list(prompt), skip_special_tokens=False).endswith(
        "assistant\n<think>\n\n</think>\n\n")


def test_grpc_chat_template_kwargs_keep_json_values() -> None:
    """A Struct holds numbers as doubles: whole ones reach the template as ints, as over REST."""
    value = {"n": 3, "x": 2.5, "on": True, "none": None, "nested": {"k": [1, "a", 0.5]}}
    request = gateway_pb2.GenerateRequest(chat=_chat(ASK), chat_template_kwargs=_kwargs(value))
    kwargs = template_kwargs_from_proto(request)
    assert kwargs == value and type(kwargs["n"]) is int and type(kwargs["nested"]["k"][0]) is int
    assert template_kwargs_from_proto(gateway_pb2.GenerateRequest(chat=_chat(ASK))) is None


@pytest.mark.parametrize(("fields", "words"), [
    ({"chat_template_kwargs": _kwargs({"messages": []})}, "set by the server"),
    ({"chat_template_kwargs": _kwargs({"add_generation_prompt": False})}, "set by the server"),
    ({"chat_template_kwargs": _kwargs({"not a name": 1})}, "not a template variable"),
    ({"chat_template_kwargs": _kwargs({f"k{i}": i for i in range(33)})}, "at most 32"),
    ({"chat": None, "text": "hi", "chat_template_kwargs": _kwargs({})}, "chat input"),
    ({"chat": None, "token_ids": gateway_pb2.TokenIds(ids=[1, 2]),
      "chat_template_kwargs": _kwargs({"enable_thinking": False})}, "chat input"),
])
def test_grpc_bad_chat_template_kwargs_are_refused(gw: Harness, fields: dict[str, Any],
                                                   words: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _grpc(gw, **({k: v for k, v in GRPC_ASK.items() if k not in fields} | fields))
    err: grpc.Call = info.value  # type: ignore[assignment]
    details = err.details() or ""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith("chat_template_kwargs") and words in details, details


TOOL_SCRIPT = ('The user wants weather.</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
               '"arguments": {"city": "Oslo"}}\n</tool_call>')


def test_grpc_reasoning_then_a_tool_call() -> None:
    """Reasoning, content and an `auto` call (hermes) in one output, over gRPC as over REST."""
    ids = smollm2_tokenizer().encode(TOOL_SCRIPT, add_special_tokens=False)
    tool: dict[str, Any] = {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}
    with Harness(Script(ids), reasoning_parser="qwen3", tool_call_parser="hermes",
                 chat_template=TEMPLATE) as h:
        out = _grpc(h, **GRPC_ASK, tools=[gateway_pb2.Tool(
            name=tool["name"], parameters=json.dumps(tool["parameters"]))])
        rest: Any = _client(h).chat.completions.create(
            model=MODEL_NAME, messages=ASK, max_tokens=100,  # type: ignore[arg-type]
            tools=[{"type": "function", "function": tool}]).choices[0]  # type: ignore[typeddict-item]
    chunks = _chunks(out)
    calls = [c for chunk in chunks for c in chunk.tool_calls]
    assert "".join(c.reasoning for c in chunks) == rest.message.reasoning == "The user wants weather."
    assert "".join(c.text for c in chunks) == rest.message.content == "Checking."
    assert calls[0].name == rest.message.tool_calls[0].function.name == "get_weather"
    assert calls[0].id and {c.index for c in calls} == {0}
    assert "".join(c.arguments for c in calls) == rest.message.tool_calls[0].function.arguments
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Oslo"}
    assert [t for c in chunks for t in c.token_ids] == ids
    assert out[-1].complete.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert rest.finish_reason == "tool_calls"


def test_parser_tags_that_are_special_tokens_are_found() -> None:
    """A parser's tag the tokenizer holds as a special token would vanish from the text: the
    gateway then decodes with special tokens (found once per tag and gateway)."""
    from gateway.state import GatewayState

    config = GatewayConfig(prefill_addresses=("127.0.0.1:1",), decode_addresses=("127.0.0.1:2",))

    async def build() -> GatewayState:  # its router's channels belong to an event loop
        return GatewayState.build(config, smollm2_tokenizer())

    state = asyncio.run(build())
    assert state.is_special_text("<|im_start|>")  # SmolLM2's control token
    assert not state.is_special_text("</think>") and not state.is_special_text("<tool_call>")
    assert state.is_special_text("<|im_start|>")  # the remembered answer


def test_reasoning_tokens_whatever_the_deltas() -> None:
    """Deltas of several tokens (a spec-decoding burst, text held back for a stop string): the
    count is the same as with one token a delta — the fewest tokens whose text holds </think>."""
    from gateway.reasoning import reasoning_token_count

    tok = smollm2_tokenizer()
    ids = tok.encode("<think>Let me think: 2 + 2 = 4.</think>\n\nIt is 4.", add_special_tokens=False)
    want = next(k for k in range(1, len(ids) + 1) if "</think>" in tok.decode(ids[:k]))
    assert 1 < want < len(ids)
    for size in range(1, 6):
        groups = [ids[i:i + size] for i in range(0, len(ids), size)]
        splitter = ReasoningSplitter("qwen3", prompt_opens=False)
        texts = [tok.decode(g) for g in groups]
        for t in texts:
            splitter.feed(t)
        splitter.finish()
        sizes = [len(g) for g in groups]
        assert reasoning_token_count(tok, ids, texts, sizes, splitter) == want, size
        # With a stop string the text may lag its tokens: the first delta's tokens carry it all.
        late = ["".join(texts)] + [""] * (len(texts) - 1)
        assert reasoning_token_count(tok, ids, late, sizes, splitter, held_back=True) == want
