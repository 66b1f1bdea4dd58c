"""Tool calling in the gateway, without a model: `tools` / `tool_choice` validation, the
constraints of named and required choices (checked against xgrammar's own acceptance of
strings), the output parsers (hermes, llama3_json, required arrays, named arguments) fed whole
and in arbitrary pieces — a stream must end where the whole text ends — and the messages and
chat template that show earlier calls and their results to the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_api.chat_template import render_chat_template
from gateway.config import GatewayConfig, GatewayConfigError
from gateway.errors import GatewayError
from gateway.openai_protocol import ChatCompletionRequest, chat_messages
from gateway.tokenization import load_chat_template
from gateway.tool_output import NamedOutput, RequiredOutput, ToolOutput
from gateway.tool_parsers import HermesOutput, Llama3JsonOutput
from gateway.tools import MAX_TOOLS, ToolCalling, tool_calling_from_request, tool_constraint

TEMPLATE = Path(__file__).resolve().parents[3] / "gateway" / "chat_templates" / "chatml_hermes_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _calling(choice: Any = "auto", tools: list[Any] | None = None, parser: str | None = "hermes",
             **extra: Any) -> ToolCalling:
    calling = tool_calling_from_request(
        {"tools": [WEATHER, TIME] if tools is None else tools, "tool_choice": choice, **extra},
        parser)
    assert calling is not None
    return calling


def _refused(extra: dict[str, Any], param: str, words: str, parser: str | None = "hermes") -> None:
    with pytest.raises(GatewayError) as err:
        tool_calling_from_request(extra, parser)
    assert err.value.param == param
    assert words in err.value.message, err.value.message


# -- the request ---------------------------------------------------------------------------------
def test_choices() -> None:
    assert tool_calling_from_request({}, "hermes") is None
    assert tool_calling_from_request({"tool_choice": "none"}, None) is None
    assert _calling(None).mode == "auto"  # OpenAI's default with tools
    assert _calling("none", parser=None).mode == "none"
    assert _calling("required", parser=None).mode == "required"
    named = _calling({"type": "function", "function": {"name": "get_time"}}, parser=None)
    assert (named.mode, named.name) == ("named", "get_time")
    assert _calling("auto").parser == "hermes"
    assert _calling("required", parallel_tool_calls=False).parallel is False
    assert [t["function"]["name"] for t in _calling().template_tools()] == ["get_weather",
                                                                           "get_time"]


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tools": {"a": 1}}, "tools", "must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name", "1-64 letters"),
    ({"tools": [TIME, TIME]}, "tools.1.function.name", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools.0.function.parameters", "JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools.0.function.description", "must be a string"),
    ({"tools": [TIME] * (MAX_TOOLS + 1)}, "tools", f"at most {MAX_TOOLS}"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [TIME], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
])
def test_malformed_requests_are_refused(extra: dict[str, Any], param: str, words: str) -> None:
    _refused(extra, param, words)


def test_auto_needs_a_parser() -> None:
    _refused({"tools": [TIME]}, "tool_choice", "--tool-call-parser", parser=None)
    _refused({"tools": [TIME], "tool_choice": "auto"}, "tool_choice", "--tool-call-parser",
             parser=None)


def test_gateway_settings() -> None:
    base = GatewayConfig(decode_addresses=("127.0.0.1:1",), colocated=True)
    assert base.replace(tool_call_parser="llama3_json").tool_call_parser == "llama3_json"
    with pytest.raises(GatewayConfigError, match="tool_call_parser"):
        base.replace(tool_call_parser="mistral")


def test_chat_template_file(tmp_path: Path) -> None:
    assert "<tool_call>" in load_chat_template(str(TEMPLATE))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="syntax error"):
        load_chat_template(str(bad))
    with pytest.raises(ValueError, match="cannot be read"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_chat_requests_take_tools_and_completions_do_not() -> None:
    from gateway.openai_protocol import CompletionRequest

    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                          "tools": [TIME]}).check_supported()
    with pytest.raises(GatewayError, match="chat completions feature"):
        CompletionRequest.model_validate({"prompt": "x", "tools": [TIME]}).check_supported()
    with pytest.raises(GatewayError, match="deprecated functions"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "functions": [{"name": "f"}]}).check_supported()


# -- constraints ---------------------------------------------------------------------------------
def _accepts(calling: ToolCalling, text: str) -> bool:
    # xgrammar (the oracle here) imports torch: imported by the tests that use it, so collecting
    # the gateway's tests stays torch-free.
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    spec = tool_constraint(calling)
    assert spec is not None and spec.json is not None
    return bool(_is_grammar_accept_string(xgr.Grammar.from_json_schema(spec.json), text))


def test_named_constraint_is_the_parameters_schema() -> None:
    named = _calling({"type": "function", "function": {"name": "get_weather"}})
    assert _accepts(named, '{"city": "Paris"}')
    assert not _accepts(named, '{"town": "Paris"}')
    free = _calling({"type": "function", "function": {"name": "get_time"}})  # no parameters
    assert _accepts(free, '{"anything": [1, 2]}')
    assert not _accepts(free, "[1]")
    assert tool_constraint(_calling("auto")) is None
    assert tool_constraint(_calling("none")) is None


def test_required_constraint_is_an_array_of_calls() -> None:
    required = _calling("required")
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    two = '{"name": "get_time", "parameters": {}}'
    assert _accepts(required, f"[{one}]")
    assert _accepts(required, f"[{one}, {two}]")
    assert not _accepts(required, "[]")
    assert not _accepts(required, '[{"name": "get_weather", "parameters": {"town": "Oslo"}}]')
    assert not _accepts(required, '[{"name": "launch", "parameters": {}}]')
    single = _calling("required", parallel_tool_calls=False)
    assert _accepts(single, f"[{one}]")
    assert not _accepts(single, f"[{one}, {two}]")


def test_constraint_past_the_size_limit_is_the_clients_error() -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(60)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": big}}
             for i in range(MAX_TOOLS)]
    with pytest.raises(GatewayError) as err:
        tool_constraint(_calling("required", tools=tools))
    assert err.value.param == "tools" and "characters" in err.value.message, err.value.message


# -- the output ----------------------------------------------------------------------------------
def _run(out: ToolOutput, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Feed `pieces`, then finish; the content and the calls a client rebuilds from the deltas."""
    content, calls = "", {}
    for delta in [*(out.feed(p) for p in pieces), out.finish()]:
        content += delta.content
        for part in delta.calls:
            call = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = part.get("id", call["id"])
            call["name"] += part.get("function", {}).get("name", "")
            call["arguments"] += part["function"].get("arguments", "")
    rebuilt = [calls[i] for i in sorted(calls)]
    # The deltas add up to the message a non-streamed response carries.
    assert (out.content or "") == content
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in out.tool_calls] == [(c["id"], c["name"], c["arguments"]) for c in rebuilt]
    return content, [{"name": c["name"], "arguments": json.loads(c["arguments"] or "null")}
                     for c in rebuilt]


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


HERMES_CASES = [
    ("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"
     "\n</tool_call>",
     "Let me check.", [{"name": "get_weather", "arguments": {"city": "Paris"}}]),
    ("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", "
     "\"arguments\": {\"x\": [1, \"</\"]}}</tool_call>\n",
     "", [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, "</"]}}]),
    ("Plain text, no call: 2 < 3 and <tool is not a tag.  ",
     "Plain text, no call: 2 < 3 and <tool is not a tag.  ", []),
    ("<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after", []),
    # Cut short by max_tokens: a block that parses anyway is a call, one that does not is text.
    ("<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": 1}}", "",
     [{"name": "a", "arguments": {"k": 1}}]),
    ("<tool_call>\n{\"name\": \"a\", \"argu", "<tool_call>\n{\"name\": \"a\", \"argu", []),
    ("text ends in a tag's start <tool_", "text ends in a tag's start <tool_", []),
    ("A.\n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\nB.", "A.\n\nB.",
     [{"name": "a", "arguments": {}}]),
]


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_whole(text: str, content: str, calls: list[dict[str, Any]],
                      incremental: bool) -> None:
    got_content, got_calls = _run(HermesOutput(parallel=True, incremental=incremental), [text])
    assert (got_content, got_calls) == (content, calls)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(HERMES_CASES), cuts=st.lists(st.integers(0, 400), max_size=12),
       incremental=st.booleans())
def test_hermes_in_pieces_ends_where_whole_does(case: tuple[str, str, list[Any]],
                                                cuts: list[int], incremental: bool) -> None:
    text, content, calls = case
    out = HermesOutput(parallel=True, incremental=incremental)
    assert _run(out, _split(text, cuts)) == (content, calls)


def _arguments_deltas(out: ToolOutput, pieces: list[str]) -> list[tuple[str | None, str]]:
    """Each call delta as (its name if it opens a call, its arguments' text)."""
    return [(part.get("function", {}).get("name"), part["function"].get("arguments", ""))
            for delta in [*(out.feed(p) for p in pieces), out.finish()] for part in delta.calls]


def test_hermes_incremental_sends_the_name_then_the_arguments_as_they_come() -> None:
    pieces = ["<tool_call>\n{\"name\": \"get_", "weather\", \"arguments\": ", "{\"city\": \"P",
              "aris}\", \"n\": {\"d\": ", "1}", "}", "}\n</tool_", "call>\nDone."]
    out = HermesOutput(parallel=True, incremental=True)
    deltas = _arguments_deltas(out, pieces)
    # The name as soon as the arguments' object starts; then each piece of it, a `}` in a string
    # and a nested object's end included, and nothing of the block's own end.
    assert deltas == [("get_weather", "{\"city\": \"P"), (None, "aris}\", \"n\": {\"d\": "),
                      (None, "1}"), (None, "}")]
    assert out.tool_calls[0]["function"]["arguments"] == '{"city": "Paris}", "n": {"d": 1}}'
    assert out.content == "\nDone." and out.finish_reason == "tool_calls"
    whole = HermesOutput(parallel=True)  # not streamed: the call once its block has ended
    assert [d for p in pieces[:-2] for d in whole.feed(p).calls] == []


@pytest.mark.parametrize("cls", [HermesOutput, Llama3JsonOutput])
def test_streamed_and_whole_arguments_are_the_same_text(cls: type[HermesOutput]) -> None:
    """The arguments as the model wrote them, streamed or not (a client comparing the two sees
    the same string); a duplicated key (the parsed object's is the last) falls back to JSON."""
    body = '{"name": "f", "arguments": {"a" :1,\n  "b": [1,2]}}'
    text = f"<tool_call>{body}</tool_call>" if cls is HermesOutput else body
    whole, streamed = cls(parallel=True), cls(parallel=True, incremental=True)
    _run(whole, [text])
    _run(streamed, list(text))
    assert (whole.tool_calls[0]["function"]["arguments"]
            == streamed.tool_calls[0]["function"]["arguments"] == '{"a" :1,\n  "b": [1,2]}')
    twice = body.replace('{"a"', '{"b": 0}, "arguments": {"a"')
    out = cls(parallel=True)
    _run(out, [f"<tool_call>{twice}</tool_call>" if cls is HermesOutput else twice])
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"a": 1, "b": [1, 2]}


def test_hermes_incremental_call_cut_short_stays_a_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {"k": [1, 2'
    out = HermesOutput(parallel=True, incremental=True)
    assert _arguments_deltas(out, [text]) == [("a", '{"k": [1, 2')]
    assert out.content is None and out.finish_reason == "tool_calls"
    whole = HermesOutput(parallel=True)  # not streamed, it is content, as it never parsed
    whole.feed(text)
    whole.finish()
    assert whole.content == text and whole.tool_calls == []


def test_hermes_incremental_without_parallel_calls_drops_the_later_ones() -> None:
    out = HermesOutput(parallel=False, incremental=True)
    text = HERMES_CASES[1][0]
    assert _run(out, _split(text, list(range(0, len(text), 7))))[1] == [
        {"name": "a", "arguments": {}}]


def test_hermes_incremental_takes_an_unusual_block_whole() -> None:
    """Arguments before the name, or not an object: nothing to stream; parsed at the end."""
    out = HermesOutput(parallel=True, incremental=True)
    text = '<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>'
    assert _run(out, list(text)) == ("", [{"name": "f", "arguments": {"q": 1}}])


def test_hermes_streams_content_before_the_call_ends() -> None:
    out = HermesOutput(parallel=True)
    assert out.feed("Sure").content == "Sure"
    assert out.feed(" <tool").content == ""       # a tag may be starting: held back
    assert out.feed("_call>{\"name\": ").content == ""
    delta = out.feed("\"a\", \"arguments\": {}}</tool_call>")
    assert delta.content == "" and delta.calls[0]["function"] == {"name": "a", "arguments": "{}"}
    assert delta.calls[0]["id"].startswith("call_") and delta.calls[0]["type"] == "function"
    assert out.finish_reason == "tool_calls"
    assert HermesOutput(parallel=True).finish_reason is None


def test_hermes_without_parallel_calls_keeps_the_first() -> None:
    text = HERMES_CASES[1][0]
    assert _run(HermesOutput(parallel=False), [text])[1] == [{"name": "a", "arguments": {}}]


def test_hermes_bare_whitespace_is_content_without_calls() -> None:
    assert _run(HermesOutput(parallel=True), ["  \n"]) == ("  \n", [])


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', "",
     [{"name": "get_weather", "arguments": {"city": "Rome"}}]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": 2}}', "",
     [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": 2}}]),
    ("The answer is 4.", "The answer is 4.", []),
    ('{"answer": 4}', '{"answer": 4}', []),
    ('{"name": "a", "parameters": {}} and then text', " and then text",
     [{"name": "a", "arguments": {}}]),
    ('{"parameters": {"z": 0}, "name": "c"}', "", [{"name": "c", "arguments": {"z": 0}}]),
]
LLAMA_CUT = '  {"name": "a", "parameters": {"k": "v"'  # max_tokens ended it


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(LLAMA_CASES), cuts=st.lists(st.integers(0, 200), max_size=10),
       incremental=st.booleans())
def test_llama3_json_in_pieces_ends_where_whole_does(case: tuple[str, str, list[Any]],
                                                     cuts: list[int], incremental: bool) -> None:
    text, content, calls = case
    assert _run(Llama3JsonOutput(parallel=True, incremental=incremental), [text]) == (content,
                                                                                      calls)
    out = Llama3JsonOutput(parallel=True, incremental=incremental)
    assert _run(out, _split(text, cuts)) == (content, calls)


def test_llama3_json_cut_short() -> None:
    """Whole, an object that never completed is content; streamed, its call was sent."""
    assert _run(Llama3JsonOutput(parallel=True), [LLAMA_CUT]) == (LLAMA_CUT.strip(), [])
    out = Llama3JsonOutput(parallel=True, incremental=True)
    assert _arguments_deltas(out, [LLAMA_CUT[:20], LLAMA_CUT[20:]]) == [("a", '{"k": "v"')]
    assert out.content is None


def test_llama3_json_incremental_streams_the_arguments() -> None:
    out = Llama3JsonOutput(parallel=True, incremental=True)
    pieces = ['{"name": "a", "parameters": {"k": ', '1}', '}; {"name": "b", ', '"arguments": {}}']
    assert _arguments_deltas(out, pieces) == [("a", '{"k": '), (None, "1}"), ("b", "{}")]
    assert [c["function"]["arguments"] for c in out.tool_calls] == ['{"k": 1}', "{}"]


def test_llama3_json_streams_each_call_when_complete() -> None:
    out = Llama3JsonOutput(parallel=True)
    assert not out.feed('{"name": "a", "parameters": {"k": ')
    assert out.feed('1}}').calls[0]["function"] == {"name": "a", "arguments": '{"k": 1}'}
    assert not out.feed("; ")
    assert out.feed('{"name": "b", "parameters": {}}').calls[0]["index"] == 1


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Oslo"}},\n '
            '{"name": "get_time", "parameters": {}}]')


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=10))
def test_required_in_pieces(cuts: list[int]) -> None:
    assert _run(RequiredOutput(), _split(REQUIRED, cuts)) == (
        "", [{"name": "get_weather", "arguments": {"city": "Oslo"}},
             {"name": "get_time", "arguments": {}}])


def test_required_cut_short_keeps_the_rest_as_content() -> None:
    out = RequiredOutput()
    content, calls = _run(out, [REQUIRED[:70]])
    assert calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert content == REQUIRED[:70].split("},", 1)[1].lstrip(" ,\n")
    assert out.finish_reason == "tool_calls"


def test_named_streams_the_arguments() -> None:
    out = NamedOutput("get_weather")
    first = out.feed('{"city"')
    assert first.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert out.feed(': "Lima"}').calls == [{"index": 0, "function": {"arguments": ': "Lima"}'}}]
    assert not out.finish()
    assert out.content is None and out.finish_reason is None  # OpenAI: a named call "stop"s
    assert out.tool_calls[0]["function"]["arguments"] == '{"city": "Lima"}'
    empty = NamedOutput("f")
    assert empty.finish().calls[0]["function"] == {"name": "f", "arguments": ""}


# -- messages and the template -------------------------------------------------------------------
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Lyon\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "20C"},
]


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return chat_messages(ChatCompletionRequest.model_validate({"messages": messages}).messages)


def test_earlier_reasoning_reaches_the_template() -> None:
    """vLLM's `reasoning` and SGLang's `reasoning_content` on an assistant turn: the template
    reads `reasoning_content` (Qwen3's shows the last turn's)."""
    for key in ("reasoning", "reasoning_content"):
        got = _messages([{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a", key: "because"}])[1]
        assert got["reasoning_content"] == got["reasoning"] == "because"
    assert "reasoning_content" not in _messages([{"role": "assistant", "content": "a"}])[0]


def test_messages_carry_calls_and_results() -> None:
    messages = _messages(CONVERSATION)
    assert messages[1]["content"] == ""
    assert messages[1]["tool_calls"][1]["function"]["arguments"] == {"city": "Lyon"}
    assert messages[3] == {"role": "tool", "content": "20C", "tool_call_id": "call_2"}
    text = render_chat_template(TEMPLATE.read_text(), messages, True, {},
                                tools=_calling().template_tools())
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n') in text
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n20C\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    # What the model wrote, parsed back, is what the conversation holds.
    start = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    written = text[start:text.index("<|im_end|>", start)]
    assert _run(HermesOutput(parallel=True), [written])[1] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Lyon"}}]


def test_template_without_tools_is_plain_chatml() -> None:
    text = render_chat_template(TEMPLATE.read_text(), [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi"}], True, {})
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages.0.tool_calls.0.function.arguments", "is not JSON"),
    ([{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages.0.tool_calls", "only assistant messages"),
    ([{"role": "user", "content": "x", "reasoning": "hm"}], "messages.0.reasoning_content",
     "only assistant messages carry reasoning"),
])
def test_bad_messages_are_refused(messages: list[dict[str, Any]], param: str, words: str) -> None:
    with pytest.raises(GatewayError) as err:
        _messages(messages)
    assert err.value.param == param and words in err.value.message


def test_flags_reach_the_gateway_config() -> None:
    """`splitserve up` hands --chat-template and --tool-call-parser to the gateway, whose
    config then holds the template's text; the colocated role takes the same flags."""
    from gateway.server import build_parser, config_from_args
    from splitserve.serve import build_serve_parser
    from splitserve.up import build_parser as up_parser
    from splitserve.up import service_argv

    args, engine_args = up_parser().parse_known_args(
        ["--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes"])
    gateway_argv = service_argv(args, engine_args)["gateway"]
    gw = build_parser().parse_args([a for a in gateway_argv if a not in ("--role", "gateway")])
    config = config_from_args(gw)
    assert config.tool_call_parser == "hermes"
    assert config.chat_template == TEMPLATE.read_text()
    colocated = build_serve_parser().parse_args(
        ["--role", "colocated", "--tool-call-parser", "llama3_json"])
    assert colocated.tool_call_parser == "llama3_json" and colocated.chat_template is None
    with pytest.raises(SystemExit):  # argparse's choices
        build_parser().parse_args(["--decode", "x:1", "--tool-call-parser", "mistral"])
