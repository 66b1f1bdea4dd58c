"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the
sequence's suffix (pure Python + numpy, no torch: the engine thread runs it between steps).

Repetitive output (code edits, quotes of the prompt, lists, loops) is where it pays: nothing to
load, no extra model, and a wrong guess costs only the verify step's extra query rows.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec import SequenceProposer


class NgramProposer(SequenceProposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids` (empty when no suffix recurs).

        The longest suffix of `max_n` down to `min_n` tokens that occurred before wins; among
        its occurrences the latest. Its continuation runs into the sequence's end when the
        match is close (a loop of period p = distance to the suffix): the drafts then go on
        repeating that period, as the loop would."""
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        # Only the last max_n tokens are needed as the pattern, but the whole sequence is the
        # haystack; one array per call (the list grows by appends the engine owns).
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._latest_match(tokens, n)
            if start < 0:
                continue
            follow = start + n                     # first token after the earlier occurrence
            period = length - follow               # >= 1: windows end before the last token
            drafts: list[int] = []
            for j in range(k):
                src = follow + j
                drafts.append(int(tokens[src]) if src < length else drafts[j - period])
            return drafts
        return []

    @staticmethod
    def _latest_match(tokens: np.ndarray, n: int) -> int:
        """Start of the latest window of `n` tokens equal to the last `n`, among the windows
        that end before the sequence's last token (so at least one token follows); -1: none."""
        haystack = tokens[:-1]
        if haystack.shape[0] < n:
            return -1
        pattern = tokens[-n:]
        # Candidates by the window's last token first: most windows fail there, and the full
        # comparison then runs on few rows.
        ends = np.flatnonzero(haystack[n - 1:] == pattern[-1])
        if ends.size == 0:
            return -1
        if n == 1:
            return int(ends[-1])
        windows = sliding_window_view(haystack, n)[ends]
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        return int(ends[hits[-1]]) if hits.size else -1
