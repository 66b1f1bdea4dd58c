"""Property-based fuzzing of the REST API: bodies drawn from the request models' JSON schemas
(what the app's OpenAPI document describes: each field's declared type, or any JSON value where
the schema is not a plain type) and arbitrary JSON, sent to
a real gateway over fake workers (real gRPC servers, tests/support/gateway_fakes.py). Whatever
the body, the answer is never a 5xx and the gateway keeps serving. Bounded: a fixed number of
examples, no shrinking database."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from gateway.openai_api import build_app
from gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer

BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
_FLOATS = st.floats(allow_nan=False, allow_infinity=False)  # what JSON can carry
JSON = st.recursive(st.none() | st.booleans() | st.integers() | _FLOATS | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    ids = list(smollm2_tokenizer().encode(" Paris is the capital of France."))
    with Harness(Script(ids)) as h:
        yield h


_TYPED: dict[str, st.SearchStrategy[Any]] = {
    "string": st.text(max_size=24), "integer": st.integers(-(2**40), 2**40),
    "number": _FLOATS | st.integers(), "boolean": st.booleans(),
    "array": st.lists(JSON, max_size=4), "object": st.dictionaries(st.text(max_size=8), JSON,
                                                                    max_size=3),
}


def _field(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value of the field's declared type (`anyOf` of types: one of them), often JSON."""
    kinds = [schema.get("type")] + [s.get("type") for s in schema.get("anyOf", ())]
    typed = [_TYPED[k] for k in kinds if isinstance(k, str) and k in _TYPED]
    return st.one_of(*typed, JSON) if typed else JSON


def _body(path: str) -> st.SearchStrategy[Any]:
    """Objects of the model's fields (a random subset, each of its declared type or not; the
    served model's name most of the time, so they get past the model check), plus one unknown
    field at times, or arbitrary JSON."""
    properties = BODIES[path].model_json_schema().get("properties", {})
    fields = st.fixed_dictionaries({}, optional={name: _field(schema)
                                                 for name, schema in properties.items()})
    named = st.tuples(fields, st.booleans()).map(
        lambda t: t[0] | {"model": MODEL_NAME} if t[1] else t[0])
    extra = st.tuples(named, st.text(max_size=16), JSON).map(lambda t: t[0] | {t[1]: t[2]})
    return st.one_of(named, named, extra, JSON)


CASES = st.sampled_from(sorted(BODIES)).flatmap(lambda p: st.tuples(st.just(p), _body(p)))


@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")  # /ping is GET and POST
def test_the_fuzzed_routes_are_the_apps_json_routes(harness: Harness) -> None:
    """The schema the app generates in-process lists every route fuzzed here as a POST."""
    assert harness.gateway is not None and harness.gateway.state is not None
    paths = build_app(harness.gateway.state).openapi()["paths"]
    assert all("post" in paths[p] for p in BODIES)


@settings(max_examples=25, deadline=None, database=None, derandomize=True,
          phases=[Phase.generate],  # bounded: a failure is reported as found, not shrunk
          suppress_health_check=list(HealthCheck))
@given(case=CASES)
def test_no_body_is_a_server_error(harness: Harness, case: tuple[str, Any]) -> None:
    path, body = case
    r = httpx.post(harness.base_url + path, json=body, timeout=30)
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])


def test_still_serving_after_the_fuzz(harness: Harness) -> None:
    r = httpx.post(harness.base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
