"""vLLM's request extras that change what the model sees or what the response says, through
the real gateway (scripted workers): `add_special_tokens` (completions and chat), `documents`
for a RAG chat template, `return_tokens_as_token_ids`, and `logits_processors` refused.

The tokenizer is SmolLM2's vocabulary with a BOS that the tokenizer adds (`add_bos_token`) and
a template that writes no BOS and renders documents, so each option shows in the prompt ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from engine_api.tokenizer import Tokenizer
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer

BOS = "<|im_start|>"
TEMPLATE = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    base = smollm2_tokenizer()
    assert isinstance(base, Tokenizer)
    path = tmp_path_factory.mktemp("bos_tokenizer")
    base.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "bos_token": BOS, "eos_token": "<|im_end|>",
        "chat_template": TEMPLATE}))
    return Tokenizer.from_file(str(path))


@pytest.fixture(scope="module")
def gw(tokenizer: Tokenizer) -> Iterator[Harness]:
    ids = tokenizer.encode(" Paris is lovely in spring.", add_special_tokens=False)
    with Harness(Script(ids), tokenizer=tokenizer) as h:
        yield h


def _post(gw: Harness, path: str, body: dict) -> httpx.Response:
    return httpx.post(gw.base_url + path, json={"model": MODEL_NAME, **body}, timeout=30)


def _sent(gw: Harness) -> list[int]:
    return list(gw.prefill[0].prefill_requests[-1].prompt_token_ids)


def test_add_special_tokens(gw: Harness, tokenizer: Tokenizer) -> None:
    bos = tokenizer.bos_token_id
    plain = tokenizer.encode("Hello", add_special_tokens=False)
    assert _post(gw, "/v1/completions", {"prompt": "Hello", "max_tokens": 1}).status_code == 200
    assert _sent(gw) == [bos, *plain]
    r = _post(gw, "/v1/completions", {"prompt": "Hello", "max_tokens": 1,
                                      "add_special_tokens": False})
    assert r.status_code == 200 and _sent(gw) == plain
    rendered = tokenizer.encode("user: Hello\nassistant:", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hello"}]
    assert _post(gw, "/v1/chat/completions", {"messages": messages,
                                              "max_tokens": 1}).status_code == 200
    assert _sent(gw) == rendered        # the template's own special tokens only (vLLM's default)
    assert _post(gw, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                              "add_special_tokens": True}).status_code == 200
    assert _sent(gw) == [bos, *rendered]


def test_documents_reach_the_template(gw: Harness, tokenizer: Tokenizer) -> None:
    docs = [{"title": "Paris", "text": "Capital of France."}, {"title": "Rome", "text": "Italy."}]
    r = _post(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                           "max_tokens": 1, "documents": docs})
    assert r.status_code == 200, r.text
    assert _sent(gw) == tokenizer.encode("[Paris: Capital of France.][Rome: Italy.]user: Hi\n"
                                         "assistant:", add_special_tokens=False)
    r = _post(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                           "documents": [{"title": 3}]})
    assert r.status_code == 400 and "documents" in r.json()["error"]["param"], r.text


def test_return_tokens_as_token_ids(gw: Harness, tokenizer: Tokenizer) -> None:
    out = _post(gw, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "logprobs": 1,
                                        "return_tokens_as_token_ids": True}).json()
    ids = tokenizer.encode(" Paris is lovely in spring.", add_special_tokens=False)[:3]
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    chat = _post(gw, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
        "return_tokens_as_token_ids": True}).json()
    assert [c["token"] for c in chat["choices"][0]["logprobs"]["content"]] == [
        f"token_id:{t}" for t in ids[:2]]


def test_logits_processors_refused(gw: Harness) -> None:
    r = _post(gw, "/v1/completions", {"prompt": "Hello", "logits_processors": ["my.Proc"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logits_processors", r.text
