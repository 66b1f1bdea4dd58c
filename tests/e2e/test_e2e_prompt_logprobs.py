"""Scoring prompts through the whole stack (real SmolLM2 workers, real gateway, the unmodified
`openai` client): `echo` with `logprobs` as lm-eval's log-likelihood tasks send it, `max_tokens`
0, vLLM's `prompt_logprobs`, the gateway's gRPC API — each checked against the model's own
log-softmax at every prompt position, disaggregated (the prefill worker scores) and colocated
(the decode worker does)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

import torch  # noqa: E402
from openai import BadRequestError, OpenAI  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine_api.tokenizer import Tokenizer  # noqa: E402
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.support.e2e_stack import MODEL_NAME, Stack  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " Paris"


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.rest_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(smollm2: LLM) -> Any:
    """ids -> [P, V] log-softmax of the model's logits at every position (in-process engine)."""
    return lambda ids: smollm2.engine.runner.prefill_logits(list(ids)).log_softmax(-1)


def _lm_eval_request(client: OpenAI, ids: list[int]) -> Any:
    """What lm-eval's `local-completions` sends for a log-likelihood request."""
    return client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=1,
                                     logprobs=1, seed=1234, echo=True)


def _check_echo(choice: Any, ids: list[int], ref: torch.Tensor, tokenizer: Tokenizer) -> None:
    lp = choice.logprobs
    n = len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:n] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
        # The top-1 token and the prompt's own are listed (lm-eval's greedy check reads both).
        best = int(ref[i - 1].argmax())
        top = lp.top_logprobs[i]
        assert tokenizer.decode([best], skip_special_tokens=False) in top
        assert lp.tokens[i] in top
    assert lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("which", ["disagg", "colocated"])
def test_lm_eval_loglikelihood_request(which: str, disagg_stack: Stack, colocated_stack: Stack,
                                       tokenizer: Tokenizer, reference: Any) -> None:
    stack = disagg_stack if which == "disagg" else colocated_stack
    ctx = tokenizer.encode(CONTEXT)
    ids = ctx + tokenizer.encode(CONTINUATION, add_special_tokens=False)
    ref = reference(ids)
    client = _client(stack)
    # Twice: the second finds the prompt in the prefix cache and must score it all the same.
    for _ in range(2):
        resp = _lm_eval_request(client, ids)
        choice = resp.choices[0]
        assert len(choice.logprobs.token_logprobs) == len(ids) + 1  # the prompt, then 1 token
        _check_echo(choice, ids, ref, tokenizer)
        assert choice.text.startswith(tokenizer.decode(ids, skip_special_tokens=False))
        # lm-eval's reading: the continuation's log-likelihood and whether it is greedy.
        cont = choice.logprobs.token_logprobs[len(ctx):-1]
        want = sum(ref[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
        assert sum(cont) == pytest.approx(want, abs=5e-3)
        assert resp.usage is not None and resp.usage.prompt_tokens == len(ids)
    stack.wait_idle()


def test_max_tokens_zero_echoes_the_prompt_alone(disagg_stack: Stack, tokenizer: Tokenizer,
                                                 reference: Any) -> None:
    resp = _client(disagg_stack).completions.create(
        model=MODEL_NAME, prompt=CONTEXT, max_tokens=0, echo=True, logprobs=2)
    choice = resp.choices[0]
    ids = tokenizer.encode(CONTEXT)
    assert choice.text == CONTEXT
    assert len(choice.logprobs.token_logprobs) == len(ids)
    _check_echo(choice, ids, reference(ids), tokenizer)
    assert all(len(t) >= 2 for t in choice.logprobs.top_logprobs[1:])
    assert choice.finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 0
    # Without echo, zero tokens is an empty request: refused.
    with pytest.raises(BadRequestError, match="max_tokens"):
        _client(disagg_stack).completions.create(model=MODEL_NAME, prompt=CONTEXT, max_tokens=0)
    disagg_stack.wait_idle()


def test_vllm_prompt_logprobs_field(disagg_stack: Stack, tokenizer: Tokenizer,
                                    reference: Any) -> None:
    ids = tokenizer.encode(CONTEXT)
    ref = reference(ids)
    resp = _client(disagg_stack).completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0, n=2,
        extra_body={"prompt_logprobs": 2})
    for choice in resp.choices:  # each choice carries its prompt's (scored once)
        entries = (choice.model_extra or {})["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for i in range(1, len(ids)):
            entry = entries[i][str(ids[i])]
            assert entry["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
            assert entry["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
            assert entry["decoded_token"] == tokenizer.decode([ids[i]], skip_special_tokens=False)
            best = int(ref[i - 1].argmax())
            assert entries[i][str(best)]["rank"] == 1
            assert len(entries[i]) in (2, 3)  # the top 2 and the prompt's own token
    chat = _client(disagg_stack).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    scored = (chat.model_extra or {})["prompt_logprobs"]
    assert scored[0] is None and all(len(e) == 1 for e in scored[1:])
    assert chat.usage is not None and len(scored) == chat.usage.prompt_tokens
    disagg_stack.wait_idle()


def test_streamed_echo_matches_the_whole_answer(disagg_stack: Stack) -> None:
    client = _client(disagg_stack)
    whole = client.completions.create(model=MODEL_NAME, prompt=CONTEXT, max_tokens=6,
                                      temperature=0, echo=True, logprobs=1)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=CONTEXT, max_tokens=6,
                                            temperature=0, echo=True, logprobs=1, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    streamed: list[float | None] = []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            streamed.extend(c.choices[0].logprobs.token_logprobs)
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    disagg_stack.wait_idle()


def test_grpc_prompt_logprobs(disagg_stack: Stack, tokenizer: Tokenizer, reference: Any) -> None:
    ids = tokenizer.encode(CONTEXT)
    ref = reference(ids)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        chunks = [r.chunk for r in stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=ids), sampling=sampling, n=2), timeout=120)
            if r.WhichOneof("response") == "chunk"]
    scored = [c for c in chunks if c.HasField("prompt_logprobs")]
    assert [c.index for c in scored] == [0]  # completion 0's first chunk, once
    lps = scored[0].prompt_logprobs
    assert list(lps.token_ids) == ids[1:] and lps.num_top == 1
    assert list(lps.logprobs) == pytest.approx(
        [ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=2e-3)
    assert list(lps.top_token_ids) == [int(ref[i - 1].argmax()) for i in range(1, len(ids))]
    assert all(r >= 1 for r in lps.ranks)
    disagg_stack.wait_idle()


def test_lm_eval_batched_requests(disagg_stack: Stack, tokenizer: Tokenizer,
                                  reference: Any) -> None:
    """lm-eval batches prompts (`batch_size` > 1): each choice echoes and scores its own."""
    batch = [tokenizer.encode(CONTEXT + c) for c in (" Paris", " Lyon", " a city in Europe")]
    resp = _lm_eval_request(_client(disagg_stack), batch)  # type: ignore[arg-type]
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2]
    for choice, ids in zip(choices, batch, strict=True):
        assert len(choice.logprobs.token_logprobs) == len(ids) + 1
        _check_echo(choice, ids, reference(ids), tokenizer)
    disagg_stack.wait_idle()
