"""Incremental detokenization with stop strings (torch-free; used by the gateway and engine).

Streaming text token by token has two traps:
1. A character may span several byte-level tokens: decoding a prefix yields "\ufffd" that later
   becomes a real character. We keep vLLM/TGI's two offsets into the token ids: text is decoded
   for the window `ids[prefix_offset:]` and diffed against `ids[prefix_offset:read_offset]`; new
   text is released only when it does not end in "\ufffd". Decoding a short window (not the
   whole sequence) keeps each call O(new tokens), and starting it a few tokens back keeps
   tokenizers that drop a leading space (SentencePiece) correct.
2. A stop string may be split across tokens: the longest suffix of the text that is a prefix of
   some stop string is held back until it either completes a stop string or cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# How many prompt tokens to decode as context in front of the first generated token.
_INITIAL_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class DetokenizerResult:
    text_delta: str            # new text to stream (may be "")
    stop_matched: str | None   # the stop string that ended generation, if any


class IncrementalDetokenizer:
    """Turns generated token ids into streamed text for one sequence.

    Mutates its own offsets and text on every `add_tokens`; not thread-safe (one per request).
    After a stop string matched, further calls return empty results.
    """

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        context = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self._ids: list[int] = context           # prompt context + generated ids
        self._prefix_offset = 0                  # window start: ids decoded as left context
        self._read_offset = len(context)         # ids before this are already turned into text
        self._held = ""                          # released text held back for stop strings
        self._output: list[str] = []             # text emitted so far
        self.finished = False                    # a stop string matched
        self.num_generated_tokens = 0

    @property
    def output_text(self) -> str:
        """All text emitted so far (stop string excluded unless include_stop_str_in_output)."""
        return "".join(self._output)

    def add_tokens(self, new_ids: Sequence[int]) -> DetokenizerResult:
        """Append generated ids; return the text they complete and any stop string matched."""
        if self.finished or not new_ids:
            return DetokenizerResult("", None)
        self._ids.extend(new_ids)
        self.num_generated_tokens += len(new_ids)
        return self._release(self._decode_new(final=False))

    def finish(self) -> DetokenizerResult:
        """End of sequence (EOS / length): flush held-back text, incomplete UTF-8 included."""
        if self.finished:
            return DetokenizerResult("", None)
        result = self._release(self._decode_new(final=True), final=True)
        self.finished = True
        return result

    def _decode_new(self, final: bool) -> str:
        """Text of ids[read_offset:], or "" while it ends inside a multi-byte character."""
        window = self._ids[self._prefix_offset:]
        if len(window) == self._read_offset - self._prefix_offset:
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        full_text = decode(window, self._skip_special)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""  # incomplete character (or only skipped special tokens): wait for more
        # Keep the window short: the just-released ids become the next call's context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def _release(self, delta: str, final: bool = False) -> DetokenizerResult:
        pending = self._held + delta
        match = self._find_stop(pending)
        if match is not None:
            start, stop = match
            out = pending[:start + (len(stop) if self._include_stop else 0)]
            self._held = ""
            self.finished = True
            self._output.append(out)
            return DetokenizerResult(out, stop)
        keep = 0 if final else self._holdback(pending)
        out, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self._output.append(out)
        return DetokenizerResult(out, None)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(index, stop) of the earliest stop string in `text`. Only `text` (held + new) can
        contain one: anything released earlier was not a prefix of any stop string."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            i = text.find(stop)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _holdback(self, text: str) -> int:
        return holdback(text, self._stop)


def holdback(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`: what
    a stream must hold back until it knows whether a marker (a stop string, a tool-call tag)
    starts there."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
