"""`SamplingParams.bad_words` (vLLM's): words the output must never contain.

Each word becomes token sequences when its request is queued: the word as written (leading
spaces dropped) and, where the tokenizer spells a word after a space with other tokens of the
same count, the word after a space (" word": a word inside text rather than at its start), as
vLLM's `bad_words` does. At each step a sequence's last token is banned (-inf: the sampler's
`mask_bad_words`) for a request whose output ends with the sequence's other tokens: a one-token word is banned always, a longer
one only when it would be completed. The output (not the prompt) is what is matched, as in vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from engine.request import Request

TokenSequences = tuple[tuple[int, ...], ...]


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]
                        ) -> TokenSequences:
    """The token sequences that spell `words` (`encode`: the tokenizer, no special tokens)."""
    return _sequences(tuple(words), encode)


@functools.lru_cache(maxsize=256)
def _sequences(words: tuple[str, ...], encode: Callable[[str], list[int]]) -> TokenSequences:
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:
            continue
        out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        # A distinct spelling of the same length (" word" as its own token(s)); a longer one is
        # the space as a token of its own followed by `bare`, which `bare` already covers.
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(dict.fromkeys(out))  # distinct, in order


def reads_output(req: Request) -> bool:
    """Whether a request's bad words are matched against its output's tail (a word of several
    tokens): its next token needs its last one on the host (async scheduling settles first)."""
    return any(len(seq) > 1 for seq in req.bad_words_token_ids)


def banned_tokens(req: Request) -> list[int]:
    """The tokens `req` may not sample next."""
    out = req.output_token_ids
    banned = []
    for seq in req.bad_words_token_ids:
        n = len(seq) - 1
        if n == 0 or (len(out) >= n and tuple(out[len(out) - n:]) == seq[:n]):
            banned.append(seq[-1])
    return banned

