"""Which tokens keep a constrained output valid UTF-8, given where its last character stands.

A byte-level vocabulary can spell a character byte by byte, and xgrammar 0.2.9's character
classes take some ill-formed sequences for one character — UTF-8-encoded surrogates (`ed a0 80`
to `ed bf bf`) among them — which every decoder then turns into U+FFFD per byte: a string that
met `maxLength` in the grammar exceeds it in the text (bench/results/h200/structured/README.md,
`tools/probes/probe_grammar_walks.py --boost-high-bytes`). This tracks RFC 3629's well-formedness over
a constrained request's output bytes: eight states (a character boundary, or the continuation
bytes still owed and their range), each with the mask of the tokens that may follow.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BOUNDARY = 0
NUM_STATES = 8
# States after a lead byte: continuation bytes owed (1-3, any of 80-BF), or a first
# continuation byte of a restricted range (RFC 3629: E0 A0-BF, ED 80-9F, F0 90-BF, F4 80-8F).
_OWE1, _OWE2, _OWE3, _AFTER_E0, _AFTER_ED, _AFTER_F0, _AFTER_F4 = range(1, 8)
_FIRST = {_AFTER_E0: (0xA0, 0xBF, _OWE1), _AFTER_ED: (0x80, 0x9F, _OWE1),
          _AFTER_F0: (0x90, 0xBF, _OWE2), _AFTER_F4: (0x80, 0x8F, _OWE2)}


def step(state: int, byte: int) -> int:
    """The state after `byte`; -1: ill-formed."""
    if state == BOUNDARY:
        if byte < 0x80:
            return BOUNDARY
        if 0xC2 <= byte <= 0xDF:
            return _OWE1
        if byte == 0xE0:
            return _AFTER_E0
        if byte == 0xED:
            return _AFTER_ED
        if 0xE1 <= byte <= 0xEF:
            return _OWE2
        if byte == 0xF0:
            return _AFTER_F0
        if byte == 0xF4:
            return _AFTER_F4
        if 0xF1 <= byte <= 0xF3:
            return _OWE3
        return -1  # a continuation byte, C0, C1, F5-FF
    if state in _FIRST:
        low, high, then = _FIRST[state]
        return then if low <= byte <= high else -1
    return state - 1 if 0x80 <= byte <= 0xBF else -1  # _OWE1 -> BOUNDARY


class Utf8Table:
    """Each token's effect on the state, and each state's mask of the tokens that may follow."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int) -> None:
        """decoded_vocab: each token's bytes (empty for special and padding tokens, which
        leave the state as it is)."""
        # Per token: None for a non-empty ASCII token (boundary to boundary, nowhere else),
        # else its end state from each start state (-1: ill-formed), () for an empty token.
        self._ends: list[tuple[int, ...] | None] = []
        valid = torch.zeros(NUM_STATES, -(-vocab_size // 32) * 32, dtype=torch.bool)
        for i in range(vocab_size):
            data = decoded_vocab[i] if i < len(decoded_vocab) else b""
            if not data:
                self._ends.append(())
                valid[:, i] = True
            elif data.isascii():
                self._ends.append(None)
                valid[BOUNDARY, i] = True
            else:
                ends = tuple(_walk(s, data) for s in range(NUM_STATES))
                self._ends.append(ends)
                valid[[s for s, e in enumerate(ends) if e >= 0], i] = True
        self.valid = valid  # [NUM_STATES, padded vocab] booleans

    def advance(self, state: int, token: int) -> int:
        """The state after `token`; -1: the output would be ill-formed."""
        ends = self._ends[token]
        if ends is None:
            return BOUNDARY if state == BOUNDARY else -1
        return ends[state] if ends else state


def _walk(state: int, data: bytes) -> int:
    for byte in data:
        state = step(state, byte)
        if state < 0:
            return -1
    return state
