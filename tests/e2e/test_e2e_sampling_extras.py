"""vLLM's `bad_words` and `truncate_prompt_tokens` extras through the whole stack (the shared
colocated SmolLM2 stack, the unmodified `openai` client and the gateway's gRPC API): a banned
word never appears and the answer is unchanged up to where it stood; a truncated prompt answers
(and embeds) exactly as its kept tokens sent alone, even one past the gateway's prompt limit."""

from __future__ import annotations

import struct

import grpc
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from openai import BadRequestError, OpenAI  # noqa: E402

from engine_api.tokenizer import Tokenizer  # noqa: E402
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.support.e2e_stack import MAX_MODEL_LEN, MODEL_NAME, RPC_TIMEOUT_S, Stack, generate  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
STORY = ("Once upon a time, in a small village by the sea, there lived an old lighthouse "
         "keeper who counted the ships every night. The three primary colors are")
KEEP = 6


@pytest.fixture(scope="module")
def client(colocated_stack: Stack) -> OpenAI:
    return OpenAI(base_url=colocated_stack.rest_url, api_key="x", max_retries=0, timeout=120)


def _chat(client: OpenAI, **extra: object) -> str:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=16, extra_body=extra or None)
    return resp.choices[0].message.content or ""


def _grpc_chat(stack: Stack, bad_words: list[str]) -> str:
    request = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user",
                                                                        content=QUESTION)]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=16, bad_words=bad_words),
        skip_special_tokens=True)
    with grpc.insecure_channel(stack.grpc_target) as channel:
        responses = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request,
                                                                        timeout=RPC_TIMEOUT_S))
    return "".join(r.chunk.text for r in responses if r.WhichOneof("response") == "chunk")


# -- bad_words --------------------------------------------------------------------------------------
def test_a_bad_word_is_never_written(colocated_stack: Stack, client: OpenAI) -> None:
    """Greedy SmolLM2 names Paris; with "Paris" banned it writes the same text up to where the
    word began, then something else — over REST and over gRPC alike."""
    free = _chat(client)
    assert "Paris" in free, free
    banned = _chat(client, bad_words=["Paris"])
    assert "Paris" not in banned, banned
    # Greedy, the same tokens up to the banned one: "The capital of France is " then another
    # word where "Paris" stood.
    assert banned.startswith(free[:free.index("Paris")]), (free, banned)
    assert _grpc_chat(colocated_stack, ["Paris"]) == banned
    assert _grpc_chat(colocated_stack, []) == free
    with pytest.raises(BadRequestError, match="bad_words"):
        _chat(client, bad_words=["Paris", " "])
    colocated_stack.wait_idle()


# -- truncate_prompt_tokens -------------------------------------------------------------------------
def test_a_truncated_prompt_answers_as_its_last_tokens(client: OpenAI,
                                                       tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(STORY)
    assert len(ids) > KEEP

    def complete(prompt: str | list[int], **extra: object) -> tuple[str, int]:
        resp = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                         max_tokens=8, extra_body={"ignore_eos": True, **extra})
        assert resp.usage is not None
        return resp.choices[0].text, resp.usage.prompt_tokens

    tail = complete(ids[-KEEP:])
    assert tail[1] == KEEP
    assert complete(ids, truncate_prompt_tokens=KEEP) == tail
    assert complete(STORY, truncate_prompt_tokens=KEEP) == tail  # cut after tokenizing


def test_a_prompt_past_the_limit_is_served_when_cut_below_it(client: OpenAI,
                                                             tokenizer: Tokenizer) -> None:
    """As vLLM: the length checks see the kept tokens."""
    story = tokenizer.encode(STORY)
    ids = (story * (MAX_MODEL_LEN // len(story) + 2))[-(MAX_MODEL_LEN + 50):]
    with pytest.raises(BadRequestError, match=f"{MAX_MODEL_LEN + 50} tokens"):
        client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4)
    resp = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=4,
                                     extra_body={"truncate_prompt_tokens": KEEP})
    assert resp.usage is not None and resp.usage.prompt_tokens == KEEP
    emb = client.embeddings.create(model=MODEL_NAME, input=ids,
                                   extra_body={"truncate_prompt_tokens": KEEP})
    assert emb.usage.prompt_tokens == KEEP
    with pytest.raises(BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4,
                                  extra_body={"truncate_prompt_tokens": 0})


def test_a_truncated_input_embeds_as_its_last_tokens(colocated_stack: Stack, client: OpenAI,
                                                     tokenizer: Tokenizer) -> None:
    """Each input of a batch keeps its last tokens (two prompts of the same end embed alike),
    text or token ids, over REST and gRPC."""
    ids = tokenizer.encode(STORY)
    tail = client.embeddings.create(model=MODEL_NAME, input=ids[-KEEP:], encoding_format="float")
    want = tail.data[0].embedding
    whole = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    assert whole.data[0].embedding != pytest.approx(want, abs=1e-3)  # the cut matters
    by_ids = client.embeddings.create(model=MODEL_NAME, input=[ids, ids[3:]],
                                      encoding_format="float",
                                      extra_body={"truncate_prompt_tokens": KEEP})
    by_text = client.embeddings.create(model=MODEL_NAME, input=STORY, encoding_format="float",
                                       extra_body={"truncate_prompt_tokens": KEEP})
    assert by_ids.usage.prompt_tokens == 2 * KEEP and by_text.usage.prompt_tokens == KEEP
    for d in [*by_ids.data, *by_text.data]:
        assert d.embedding == pytest.approx(want, abs=1e-5)
    with grpc.insecure_channel(colocated_stack.grpc_target) as channel:
        resp = gateway_pb2_grpc.GatewayStub(channel).Embed(gateway_pb2.EmbeddingsRequest(
            inputs=[gateway_pb2.EmbeddingInput(text=STORY)], truncate_prompt_tokens=KEEP),
            timeout=RPC_TIMEOUT_S)
    assert resp.prompt_tokens == KEEP
    got = struct.unpack(f"<{len(want)}f", resp.data[0].embedding)
    assert list(got) == pytest.approx(want, abs=1e-5)
    colocated_stack.wait_idle()


def test_grpc_generate_truncates(colocated_stack: Stack, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(STORY)
    tail = generate(colocated_stack.grpc_target, ids[-KEEP:], 8)
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=ids), truncate_prompt_tokens=KEEP,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        skip_special_tokens=True)
    with grpc.insecure_channel(colocated_stack.grpc_target) as channel:
        responses = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request,
                                                                        timeout=RPC_TIMEOUT_S))
    tokens = [t for r in responses if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]
    assert tokens == tail.token_ids
    assert responses[-1].complete.usage.prompt_tokens == KEEP == tail.complete.usage.prompt_tokens
    colocated_stack.wait_idle()
