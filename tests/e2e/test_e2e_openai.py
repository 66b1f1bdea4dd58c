"""The unmodified `openai` client against the disaggregated stack (real SmolLM2, real workers)."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from openai import OpenAI  # noqa: E402
from openai.types.chat import ChatCompletionMessageParam  # noqa: E402

from engine_api.tokenizer import Tokenizer  # noqa: E402
from tests.support.e2e_stack import MODEL_NAME, Stack  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
CAPITAL_QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def client(disagg_stack: Stack) -> OpenAI:
    return OpenAI(base_url=disagg_stack.rest_url, api_key="x", max_retries=0, timeout=120)


def _chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(str(text), add_special_tokens=False)


def test_models_lists_the_served_model(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_chat_greedy_names_paris(client: OpenAI, tokenizer: Tokenizer) -> None:
    resp = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL_QUESTION,
                                          temperature=0, max_tokens=16, logprobs=True)
    answer = resp.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(_chat_prompt_ids(tokenizer, [
        {"role": "user", "content": QUESTION}]))
    # One logprobs entry per generated token (EOS included): usage counts exactly those.
    assert resp.choices[0].logprobs is not None and resp.choices[0].logprobs.content is not None
    assert resp.usage.completion_tokens == len(resp.choices[0].logprobs.content)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_matches_non_stream(client: OpenAI, tokenizer: Tokenizer) -> None:
    full = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL_QUESTION,
                                          temperature=0, max_tokens=16)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CAPITAL_QUESTION, temperature=0, max_tokens=16,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert full.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens)


def test_completion_length_usage_counts_streamed_tokens(client: OpenAI, tokenizer: Tokenizer) -> None:
    prompt = "The three primary colors are"
    max_tokens = 10
    stream = client.completions.create(
        model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "logprobs": 0})
    chunks = list(stream)
    # With logprobs every token produces a chunk (even one whose text is held back), so the
    # number of streamed tokens is visible to the client.
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs is not None
                for t in c.choices[0].logprobs.tokens or []]
    assert len(streamed) == max_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == max_tokens == len(streamed)
    assert usage.prompt_tokens == len(tokenizer.encode(prompt))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                     max_tokens=max_tokens, extra_body={"ignore_eos": True})
    assert full.choices[0].text == text
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (
        usage.prompt_tokens, usage.completion_tokens)


def test_completion_token_id_prompt(client: OpenAI, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Once upon a time")
    by_text = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                        temperature=0, max_tokens=8)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)


def test_a_batch_of_prompts_answers_each_as_alone(client: OpenAI) -> None:
    """A batched `prompt`: choice i is what prompt i gets alone (greedy), in order."""
    prompts = ["The three primary colors are", "Once upon a time", "My favourite fruit is"]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, temperature=0, max_tokens=8)
             for p in prompts]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, temperature=0,
                                      max_tokens=8)
    by_index = sorted(batch.choices, key=lambda c: c.index)
    assert [c.index for c in by_index] == [0, 1, 2]
    assert [c.text for c in by_index] == [r.choices[0].text for r in alone]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone if r.usage)
    assert batch.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone if r.usage)


def test_n_greedy_completions_agree(client: OpenAI) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt="My favourite fruit is", n=2,
                                     temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.choices[0].text == resp.choices[1].text
    assert resp.usage is not None and resp.usage.completion_tokens == 16


def test_stop_string_mid_decode_cancels_the_rest(client: OpenAI, disagg_stack: Stack) -> None:
    prompt = "List the days of the week: Monday, Tuesday,"
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                     max_tokens=16, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    words = [w for w in text.split() if len(w) > 3]
    assert len(words) >= 2, text
    stop = words[1]  # a word that comes after the first decode steps
    cut = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                    max_tokens=16, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.usage is not None and cut.usage.completion_tokens < 16
    disagg_stack.wait_idle()  # the decode call was cancelled at the stop string: KV freed


def test_logit_bias_and_allowed_token_ids_steer_the_real_model(client: OpenAI,
                                                                tokenizer: Tokenizer) -> None:
    """Applied on both workers: the prefill worker samples the first token, the decode worker
    the rest (greedy, so any token not steered would be the model's own choice)."""
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL_QUESTION,
                                           temperature=0, max_tokens=6)
    assert "Paris" in (plain.choices[0].message.content or "")
    paris = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" Paris", "Paris")]
    banned = client.chat.completions.create(model=MODEL_NAME, messages=CAPITAL_QUESTION,
                                            temperature=0, max_tokens=6,
                                            logit_bias={str(t): -100 for t in paris})
    assert "Paris" not in (banned.choices[0].message.content or "")
    [cat] = tokenizer.encode(" cat", add_special_tokens=False)
    [dog] = tokenizer.encode(" dog", add_special_tokens=False)
    forced = client.completions.create(model=MODEL_NAME, prompt="The weather today is",
                                       temperature=0, max_tokens=5, logit_bias={str(cat): 100},
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " cat" * 5
    allowed = client.completions.create(model=MODEL_NAME, prompt="My favourite pet is a",
                                        temperature=0.8, seed=3, max_tokens=8,
                                        extra_body={"ignore_eos": True,
                                                    "allowed_token_ids": [cat, dog]})
    words = allowed.choices[0].text.split()
    assert len(words) == 8 and set(words) <= {"cat", "dog"}, allowed.choices[0].text
