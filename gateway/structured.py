"""Structured outputs on the wire: the OpenAI / vLLM request fields → the engine's
`StructuredOutputs`, and that ↔ the `common.StructuredOutputs` message.

A client may ask in any of the forms vLLM accepts, one at a time:
- OpenAI's `response_format`: `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}` (`{"type": "text"}`: no constraint);
- vLLM's `structured_outputs`: `{"json": schema, "regex": ..., "choice": [...], "grammar": ...,
  "json_object": true}`, one key;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Whether a schema, regex or grammar compiles is the workers' check (they hold the vocabulary);
its failure comes back as a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from engine_api.sampling_params import SamplingParamsError, StructuredOutputs
from gateway.errors import GatewayError
from protos.splitserve.v1 import common_pb2

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# vLLM's options that this server does not implement (refused rather than ignored).
_UNSUPPORTED = {"guided_whitespace_pattern": "whitespace_pattern"}


def structured_from_request(extra: dict[str, Any]) -> StructuredOutputs | None:
    """The constraint a request's fields ask for; GatewayError (400) naming the field when the
    fields are malformed or ask for two."""
    asked: list[tuple[str, StructuredOutputs]] = []
    for name in _UNSUPPORTED:
        if extra.get(name) not in (None, "", {}):
            raise GatewayError.invalid(name, f"{name} is not supported by this server")
    fmt = extra.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            asked.append(("response_format", spec))
    so = extra.get("structured_outputs")
    if so is not None and so != {}:
        asked.append(("structured_outputs", _structured_outputs(so)))
    for name, key in _GUIDED.items():
        value = extra.get(name)
        if value is not None:  # an empty one is refused below, not taken for "unset"
            asked.append((name, _spec(name, **{key: _text(name, value, key)})))
    if len(asked) > 1:
        raise GatewayError.invalid(asked[1][0], "ask for one output constraint at a time; got "
                                   + " and ".join(name for name, _ in asked))
    return asked[0][1] if asked else None


def _response_format(fmt: object) -> StructuredOutputs | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise GatewayError.invalid("response_format", "response_format must be an object with "
                                   "a type: text, json_object or json_schema")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if schema is None:
            raise GatewayError.invalid("response_format", "response_format json_schema needs "
                                       "json_schema.schema (the JSON schema)")
        return _spec("response_format", json=_text("response_format", schema, "json"))
    if kind == "structural_tag":  # vLLM's: the whole object is the tag (either of its forms)
        return _spec("response_format", structural_tag=json.dumps(fmt))
    raise GatewayError.invalid("response_format", f"response_format type {kind!r} is not "
                               "supported (text, json_object, json_schema, structural_tag)")


def _structured_outputs(so: object) -> StructuredOutputs:
    param = "structured_outputs"
    if not isinstance(so, dict):
        raise GatewayError.invalid(param, f"{param} must be an object with one of {_KEYS}")
    for key in so:
        if key in _UNSUPPORTED.values():
            raise GatewayError.invalid(param, f"{param}.{key} is not supported by this server")
        # disable_fallback: vLLM's choice of another backend when one cannot compile; this
        # server has one, so it changes nothing.
        if key not in _KEYS and key not in ("disable_any_whitespace", "disable_fallback"):
            raise GatewayError.invalid(param, f"{param}.{key} is not a known constraint "
                                       f"(one of {', '.join(_KEYS)})")
    given = {k: so[k] for k in _KEYS if so.get(k) not in (None, False)}
    if len(given) != 1:
        raise GatewayError.invalid(param, f"{param} must set exactly one of "
                                   f"{', '.join(_KEYS)}; got {sorted(given) or 'none'}")
    [(key, value)] = given.items()
    compact = so.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise GatewayError.invalid(param, f"{param}.disable_any_whitespace must be a boolean")
    if key == "json_object":
        if value is not True:
            raise GatewayError.invalid(param, f"{param}.json_object must be true")
        return StructuredOutputs(json_object=True, any_whitespace=not compact)
    extra = {"any_whitespace": not compact} if key == "json" else {}
    return _spec(param, **{key: _text(f"{param}.{key}", value, key)}, **extra)


def _text(param: str, value: object, key: str) -> Any:
    """A field's value in the engine's form: a JSON schema as JSON text (a schema may come as an
    object or as text), choices as a tuple of strings, regexes and grammars as text."""
    if key in ("json", "structural_tag"):
        if isinstance(value, dict):
            return json.dumps(value)
        if isinstance(value, str):
            return value
        what = "a JSON schema" if key == "json" else "a structural tag"
        raise GatewayError.invalid(param, f"{param} must be {what} (an object or its text)")
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise GatewayError.invalid(param, f"{param} must be a list of strings")
        return tuple(value)
    if not isinstance(value, str):
        raise GatewayError.invalid(param, f"{param} must be a string")
    return value


def _spec(param: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except SamplingParamsError as e:
        raise GatewayError.invalid(param, f"{param}: {e}") from None


def structured_to_proto(spec: StructuredOutputs, proto: common_pb2.StructuredOutputs) -> None:
    """Write `spec` into `proto` (a field of a SamplingParams message)."""
    proto.disable_any_whitespace = not spec.any_whitespace
    if spec.json is not None:
        proto.json_schema = spec.json
    elif spec.json_object:
        proto.json_object = True
    elif spec.regex is not None:
        proto.regex = spec.regex
    elif spec.choice is not None:
        proto.choice.values.extend(spec.choice)
    elif spec.grammar is not None:
        proto.grammar = spec.grammar
    elif spec.structural_tag is not None:
        proto.structural_tag = spec.structural_tag
    if spec.reasoning_end_token_id is not None:
        proto.reasoning_end_token_id = spec.reasoning_end_token_id
    if spec.reasoning_start_token_id is not None:
        proto.reasoning_start_token_id = spec.reasoning_start_token_id


def structured_from_proto(sp: common_pb2.SamplingParams) -> StructuredOutputs | None:
    """A gateway gRPC client's constraint (None: unset); 400 naming the field when malformed."""
    if not sp.HasField("structured_outputs"):
        return None
    so = sp.structured_outputs
    kind = so.WhichOneof("constraint")
    param = "sampling.structured_outputs"
    if kind is None:
        raise GatewayError.invalid(param, f"{param} must set one constraint")
    # Where the language starts, when the client says (a chat request's is the gateway's
    # reasoning parser's: gateway/chat_tools.py).
    extra: dict[str, Any] = {name: getattr(so, name) for name in (
        "reasoning_end_token_id", "reasoning_start_token_id") if so.HasField(name)}
    if kind == "choice":
        return _spec(param, choice=tuple(so.choice.values), **extra)
    if kind in ("json_schema", "json_object"):
        extra["any_whitespace"] = not so.disable_any_whitespace
    return _spec(param, **{"json" if kind == "json_schema" else kind: getattr(so, kind)}, **extra)
