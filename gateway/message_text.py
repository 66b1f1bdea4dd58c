"""A chat message's text is text: a literal special token in it (a user writing
`<|im_start|>system ...`) is tokenized as the characters it is made of, never as the special
token the template uses to mark turns, as vLLM and transformers' own renderers keep a message
from opening a turn of its own.

The template still writes its own special tokens. Before it renders, each special token's text
inside a message's text is replaced by a marker of private-use characters (which templates pass
through unchanged, trimmed or split as they may be); after it renders, the text between markers
is tokenized as usual and each marker becomes the special token's text tokenized as text.
A prompt whose messages hold no special token text (nearly all) is tokenized whole, as before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gateway.tokenization import TokenizerLike

# The marker of special token k: U+E000, k in decimal, U+E001 (Unicode's private use area).
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
# Message fields whose text the template renders as written.
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")


def shield_special_tokens(messages: Sequence[dict[str, Any]], specials: Sequence[str]
                          ) -> list[dict[str, Any]] | None:
    """`messages` with each special token's text in their text replaced by its marker, or None
    when there is none to replace (render them as they are)."""
    pattern = _specials_pattern(specials)
    if pattern is None:
        return None
    index = {text: k for k, text in enumerate(specials)}
    out: list[dict[str, Any]] = []
    found = False
    for message in messages:
        copy = dict(message)
        for name in _TEXT_FIELDS:
            value = copy.get(name)
            if isinstance(value, str) and pattern.search(value):
                copy[name] = pattern.sub(lambda m: f"{_OPEN}{index[m.group(0)]}{_CLOSE}", value)
                found = True
        out.append(copy)
    return out if found else None


def encode_shielded(text: str, tokenizer: TokenizerLike, add_special_tokens: bool) -> list[int]:
    """A prompt rendered from shielded messages, tokenized: the text between markers as
    `encode` tokenizes it (the template's special tokens recognized; BOS, if asked, once at the
    start), each marker as its special token's text taken as text."""
    specials = tokenizer.special_token_texts
    ids: list[int] = []
    start = 0
    for match in _MARKER.finditer(text):
        k = int(match.group(1))
        if k >= len(specials):  # not one of ours (the client's own private-use text): text
            continue
        ids += _encode_piece(tokenizer, text[start:match.start()], add_special_tokens and not start)
        ids += tokenizer.encode_as_text(specials[k])
        start = match.end()
    return ids + _encode_piece(tokenizer, text[start:], add_special_tokens and not start)


def _encode_piece(tokenizer: TokenizerLike, piece: str, add_special_tokens: bool) -> list[int]:
    if not piece and not add_special_tokens:
        return []
    return tokenizer.encode(piece, add_special_tokens=add_special_tokens)


def _specials_pattern(specials: Sequence[str]) -> re.Pattern[str] | None:
    texts = [s for s in specials if s]
    return re.compile("|".join(re.escape(s) for s in texts)) if texts else None
