"""Render Hugging Face chat templates (Jinja2) the way `transformers.apply_chat_template` does.

Torch-free: the gateway renders templates. Templates are untrusted code from model files, so
they run in jinja2's ImmutableSandboxedEnvironment, with the same globals and filters as
transformers (`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, the
`{% generation %}` tag and loop controls).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """Bad messages or a template that fails to render; the message says which and why."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API declares a class-level set)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and '; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile `source` once (cached); ChatTemplateError on a syntax error."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e}") from e


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check `messages` is a non-empty list of {"role": str, "content": str, ...} dicts."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string, got "
                                    f"{type(content).__name__}")
    return messages


def render_chat_template(template: str, messages: list[dict[str, Any]],
                         add_generation_prompt: bool = True,
                         special_tokens: dict[str, str | None] | None = None,
                         **kwargs: Any) -> str:
    """Render `messages` with `template`.

    special_tokens: e.g. {"bos_token": "<s>", "eos_token": "</s>"}, exposed as template variables.
    kwargs: extra template variables (tools, documents, ...), as in transformers.
    """
    messages = validate_messages(messages)
    compiled = compile_template(template)
    variables: dict[str, Any] = {"tools": None, "documents": None, **(special_tokens or {}),
                                 **kwargs}
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
