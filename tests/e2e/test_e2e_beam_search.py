"""vLLM's `use_beam_search` through the whole stack (real SmolLM2 workers, real gateway, the
unmodified `openai` client): the `n` choices are the in-process engine's `LLM.beam_search`
sequences for the same prompt ids, best first — completions and chat, disaggregated and
colocated — and the fields beam search would ignore are 400s naming them. No KV block left
behind.
"""

from __future__ import annotations

import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from openai import OpenAI  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine_api.beam_search import BeamSearchParams  # noqa: E402
from tests.support.e2e_stack import MODEL_NAME, Stack  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name a fruit."}]


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.rest_url, api_key="x", max_retries=0, timeout=120)


def _post(stack: Stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.rest_url + path, json={"model": MODEL_NAME, **body}, timeout=120)


@pytest.mark.parametrize("which", ["disagg", "colocated"])
def test_completions_match_the_engine(which: str, disagg_stack: Stack, colocated_stack: Stack,
                                      smollm2: LLM) -> None:
    stack = disagg_stack if which == "disagg" else colocated_stack
    ids = stack.tokenizer.encode(PROMPT)
    [want] = smollm2.beam_search({"prompt_token_ids": ids},
                                 BeamSearchParams(beam_width=3, max_tokens=6))
    reply = _client(stack).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=3, temperature=0,
        extra_body={"use_beam_search": True, "return_token_ids": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [(c.model_extra or {})["token_ids"] for c in reply.choices] == [
        s.output_token_ids for s in want.sequences]
    assert all((c.model_extra or {})["prompt_token_ids"] == ids for c in reply.choices)
    assert [c.text for c in reply.choices] == [
        stack.tokenizer.decode(s.output_token_ids) for s in want.sequences]
    assert [c.finish_reason for c in reply.choices] == [s.finish_reason for s in want.sequences]
    assert len({c.text for c in reply.choices}) == 3          # three distinct hypotheses
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == sum(len(s.output_token_ids) for s in want.sequences)
    stack.wait_idle()


def test_chat_matches_the_engine(disagg_stack: Stack, smollm2: LLM) -> None:
    r = httpx.post(disagg_stack.rest_url.removesuffix("/v1") + "/tokenize",
                   json={"model": MODEL_NAME, "messages": MESSAGES}, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    params = BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=0.5)
    [want] = smollm2.beam_search({"prompt_token_ids": ids}, params)
    reply = _client(disagg_stack).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, n=2,  # type: ignore[arg-type]
        extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.message.content for c in reply.choices] == [
        disagg_stack.tokenizer.decode(s.output_token_ids) for s in want.sequences]
    assert [c.finish_reason for c in reply.choices] == [s.finish_reason for s in want.sequences]
    disagg_stack.wait_idle()


def test_what_beam_search_refuses(disagg_stack: Stack) -> None:
    for body, param in [
            ({"prompt": PROMPT, "n": 2, "use_beam_search": True, "stream": True}, "stream"),
            ({"prompt": PROMPT, "n": 2, "use_beam_search": True, "stop": ["."]}, "stop"),
            ({"prompt": PROMPT, "n": 2, "use_beam_search": True, "logprobs": 1}, "logprobs"),
            ({"prompt": PROMPT, "n": 11, "use_beam_search": True}, "n"),
            ({"prompt": PROMPT, "length_penalty": 0.5}, "length_penalty"),
            ({"prompt": PROMPT, "use_beam_search": "yes"}, "use_beam_search")]:
        r = _post(disagg_stack, "/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = _post(disagg_stack, "/chat/completions", {"messages": MESSAGES, "use_beam_search": True,
                                                  "n": 2, "top_logprobs": 2, "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    disagg_stack.wait_idle()


def test_the_grpc_api(disagg_stack: Stack, smollm2: LLM) -> None:
    """Gateway.Generate with use_beam_search: each sequence one chunk, then its complete."""
    import grpc

    from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    ids = disagg_stack.tokenizer.encode(PROMPT)
    [want] = smollm2.beam_search({"prompt_token_ids": ids},
                                 BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.5))
    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        out = list(stub.Generate(gateway_pb2.GenerateRequest(
            text=PROMPT, n=3, sampling=common_pb2.SamplingParams(max_tokens=5),
            use_beam_search=True, length_penalty=0.5), timeout=120))
        chunks = [r.chunk for r in out if r.WhichOneof("response") == "chunk"]
        completes = [r.complete for r in out if r.WhichOneof("response") == "complete"]
        assert [list(c.token_ids) for c in chunks] == [s.output_token_ids for s in want.sequences]
        assert [c.index for c in chunks] == [c.index for c in completes] == [0, 1, 2]
        assert all(c.usage.prompt_tokens == len(ids) for c in completes)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gateway_pb2.GenerateRequest(
                text=PROMPT, n=2, stop=["."], use_beam_search=True), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stop" in (err.value.details() or "")
    disagg_stack.wait_idle()
