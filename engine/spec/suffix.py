"""Suffix decoding: drafts from suffix trees over this request's own tokens and over the recent
outputs of other requests on the worker (as Arctic Inference's and vLLM's `suffix` method).

Each tree is a trie of every suffix of its text, cut at `max_depth` tokens, with a count on
every node (how many times that token string occurred). To draft, the longest suffix of the
sequence (up to `max_depth` tokens) found in a tree is its match; from the match's node the
drafts follow the most frequent child while its share of its parent's count stays at least
`min_token_prob`, for at most `max_spec_factor` × the match's length tokens (a longer match is
a surer one) and the request's cap. The request's own tree and the shared one both answer; the
draft whose path is likelier (the sum of its steps' shares) wins.

Pure Python, run between steps on the engine thread: appending a token touches at most
`max_depth` nodes, a lookup walks at most `max_depth` suffixes of at most `max_depth` tokens.
The shared tree holds the outputs of the last `max_cached_requests` finished requests, at most
`max_cached_tokens` tokens in all: the oldest are taken out (their counts subtracted) first;
one taken out before it was all indexed leaves only what entered (`_evict`).

Indexing is bounded per call (`max_index_tokens`): at depth 24 a token costs about 10 us (640
tokens in 6.45 ms on the 2-core CPU; the H100 traces show 6-7 ms of drafting in the steps where
such a request was first proposed for), so a 640-token request's first proposal held every
running sequence's step by that much (an 8K prompt, by extrapolation, by ~80 ms), and so did
each finished output entering the shared tree. A call first indexes the tokens that the
requests already caught up produced since their last proposal (1 + k at most each), then the
rest of its budget goes to the trees still catching up (a new request's prompt; the nearest to
done first) and to the shared tree's pending changes.
A request drafts from what its tree holds meanwhile: a match against its earlier tokens is as
valid in a prefix of its text.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.spec import draft_cap

if TYPE_CHECKING:
    from engine.request import Request


@dataclass(slots=True)
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class SuffixTree:
    """The depth-bounded suffix trie of one or more token sequences (counts by occurrence)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0

    def add(self, tokens: Sequence[int], active: list[_Node] | None = None,
            delta: int = +1) -> list[_Node]:
        """Count every suffix window (up to `max_depth` tokens) that ends in `tokens`.

        `active`: what an earlier `add` of the same sequence's prefix returned (the nodes of
        the suffixes ending at its last token, shortest first), so that `tokens` continue that
        sequence; returns the same for `tokens`' end. Each token touches one node per depth.
        `delta` -1 takes the windows out again, in the same pieces (`remove`)."""
        nodes = [] if active is None else active
        for t in tokens:
            nodes = self._feed(nodes, t, delta)
        return nodes

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `add(tokens)` of a whole sequence (nodes whose count drops to zero go)."""
        self.add(tokens, None, -1)

    def _feed(self, active: list[_Node], token: int, delta: int) -> list[_Node]:
        """The suffixes ending at `token`: the root's child, and each of `active` (the
        suffixes ending just before it) extended by it, up to `max_depth` tokens."""
        out: list[_Node] = []
        for parent in (self.root, *active[:self.max_depth - 1]):
            child = self._bump(parent, token, delta)
            if child is None:  # (removing only: never added)
                break
            out.append(child)
        return out

    def _bump(self, parent: _Node, token: int, delta: int) -> _Node | None:
        child = parent.children.get(token)
        if child is None:
            if delta < 0:
                return None
            child = parent.children[token] = _Node()
            self.num_nodes += 1
        child.count += delta
        if child.count <= 0:  # gone; its longer strings go in this same removal
            del parent.children[token]
            self.num_nodes -= 1
        return child

    def match(self, context: Sequence[int]) -> tuple[_Node, int] | None:
        """The node of the longest suffix of `context` (at most `max_depth` tokens) the tree
        holds with a continuation, and its length; None when not even the last token is."""
        n = len(context)
        for length in range(min(self.max_depth, n), 0, -1):
            node = self.root
            for t in context[n - length:]:
                child = node.children.get(t)
                if child is None:
                    break
                node = child
            else:
                if node.children:
                    return node, length
        return None

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float]:
        """Drafts following `context` and their score (the sum of each step's probability)."""
        found = self.match(context)
        if found is None or max_tokens <= 0:
            return [], 0.0
        node, length = found
        limit = min(max_tokens, max(1, int(max_spec_factor * length)))
        drafts: list[int] = []
        score = 0.0
        prob = 1.0
        while len(drafts) < limit and node.children:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            total = sum(c.count for c in node.children.values())
            prob *= child.count / total
            if prob < min_token_prob:
                break
            drafts.append(token)
            score += prob
            node = child
        return drafts, score


# Tokens one call indexes at most (see the module's docstring): about 1.3 ms at ~10 us a token
# (an estimate); a request's new tokens (1 + k a step) are indexed whatever is left.
MAX_INDEX_TOKENS = 128


@dataclass(slots=True)
class _Tracked:
    tree: SuffixTree
    tokens: list[int]          # what the request's tree holds (its prompt and output so far)
    num_prompt_tokens: int
    active: list[_Node] = field(default_factory=list)  # the tree's nodes at the tokens' end
    source: list[int] = field(default_factory=list)    # the request's tokens (its live list)


@dataclass(slots=True, eq=False)  # compared by identity: two outputs may be equal
class _SharedChange:
    """A finished output entering the shared tree (+1) or leaving it (-1), indexed in pieces."""
    tokens: list[int]
    delta: int
    done: int = 0
    active: list[_Node] = field(default_factory=list)


class SuffixProposer:
    """Suffix decoding over each request's own tokens and the worker's recent outputs.

    Stateful: a request's tree grows by the tokens since its last proposal (at most
    `max_index_tokens` a call in all, see the module's docstring); `release` (the request
    finished or was aborted) moves its output into the shared tree."""

    def __init__(self, max_depth: int = 24, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_cached_requests: int = 64,
                 max_cached_tokens: int = 65536,
                 max_index_tokens: int = MAX_INDEX_TOKENS) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if max_index_tokens < 1:
            raise ValueError(f"max_index_tokens must be >= 1, got {max_index_tokens}")
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.max_index_tokens = max_index_tokens
        self.shared = SuffixTree(max_depth)
        self._cached: deque[_SharedChange] = deque()  # the cached outputs' adds, oldest first
        self._cached_tokens = 0
        self._shared_changes: deque[_SharedChange] = deque()
        self._tracked: dict[str, _Tracked] = {}
        # Host seconds spent catching up (a new request's text, the shared tree's changes):
        # once per request, not a cost of a step's rows; the engine leaves it out of the step
        # cost it measures (`take_index_seconds`).
        self._index_seconds = 0.0

    def take_index_seconds(self) -> float:
        """Seconds spent catching up since the last call."""
        seconds, self._index_seconds = self._index_seconds, 0.0
        return seconds

    @property
    def backlog(self) -> int:
        """Tokens waiting to be indexed: the shared tree's pending changes (the requests'
        own trees catch up as they are proposed for)."""
        return sum(len(c.tokens) - c.done for c in self._shared_changes)

    def propose_batch(self, reqs: Sequence[Request]) -> list[list[int]]:
        tracked = [self._track(req) for req in reqs]
        # A request caught up at its last proposal gained at most 1 + k tokens: those first,
        # whatever the budget, so that one long new prompt does not hold the others' trees.
        budget = self.max_index_tokens
        behind: list[tuple[int, int, _Tracked, list[int]]] = []
        for i, (t, req) in enumerate(zip(tracked, reqs, strict=True)):
            tokens = req.all_token_ids
            missing = len(tokens) - len(t.tokens)
            if missing <= 1 + max(req.num_speculative_tokens, 1):
                budget -= self._index(t, tokens, missing)
            elif missing > 0:
                behind.append((missing, i, t, tokens))
        behind.sort(key=lambda b: b[:2])  # the nearest to caught up first: more of them draft
        started = time.perf_counter()
        for _, _, t, tokens in behind:
            if budget <= 0:
                break
            budget -= self._index(t, tokens, budget)
        self._apply_shared_changes(budget)
        self._index_seconds += time.perf_counter() - started
        return [self._speculate(t, req) for t, req in zip(tracked, reqs, strict=True)]

    def propose(self, req: Request) -> list[int]:
        return self.propose_batch([req])[0]

    def propose_caught_up(self, reqs: Sequence[Request]) -> list[list[int] | None]:
        """As `propose_batch`, but None for a request whose tree does not yet hold all of its
        tokens: drafts from part of a request's text are fewer than suffix decoding gives it,
        so shadow proposals (shadow.py), which measure the method, wait until it caught up."""
        drafts = self.propose_batch(reqs)
        return [d if len(self._tracked[r.request_id].tokens) >= r.num_tokens else None
                for r, d in zip(reqs, drafts, strict=True)]

    def _track(self, req: Request) -> _Tracked:
        tracked = self._tracked.get(req.request_id)
        if tracked is None:
            tracked = self._tracked[req.request_id] = _Tracked(
                SuffixTree(self.max_depth), [], req.num_prompt_tokens)
        tracked.source = req.all_token_ids
        return tracked

    @staticmethod
    def _index(tracked: _Tracked, tokens: list[int], limit: int) -> int:
        """Index up to `limit` of `tokens` past what `tracked`'s tree holds; how many."""
        old = len(tracked.tokens)
        new = tokens[old:old + limit]
        if new:
            tracked.tokens.extend(new)
            tracked.active = tracked.tree.add(new, tracked.active)
        return len(new)

    def _speculate(self, tracked: _Tracked, req: Request) -> list[int]:
        k = draft_cap(req)
        if k <= 0:
            return []
        tokens = req.all_token_ids
        # The request's own tree holds the context (or, catching up, a prefix of it): a match
        # there must continue strictly before the end, which `match` ensures (the last window
        # has no child yet unless the same string occurred earlier).
        own = tracked.tree.speculate(tokens, k, self.max_spec_factor, self.min_token_prob)
        shared = self.shared.speculate(tokens, k, self.max_spec_factor, self.min_token_prob)
        return own[0] if own[1] >= shared[1] else shared[0]

    def _apply_shared_changes(self, budget: int) -> None:
        """The shared tree's pending changes, oldest first, `budget` tokens at most."""
        while budget > 0 and self._shared_changes:
            change = self._shared_changes[0]
            piece = change.tokens[change.done:change.done + budget]
            change.active = self.shared.add(piece, change.active, change.delta)
            change.done += len(piece)
            budget -= len(piece)
            if change.done >= len(change.tokens):
                self._shared_changes.popleft()

    def release(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None or self.max_cached_requests <= 0:
            return
        output = tracked.source[tracked.num_prompt_tokens:][-self.max_cached_tokens:]
        if not output:
            return
        added = _SharedChange(output, +1)
        self._shared_changes.append(added)
        self._cached.append(added)
        self._cached_tokens += len(output)
        while (len(self._cached) > self.max_cached_requests
               or self._cached_tokens > self.max_cached_tokens):
            old = self._cached.popleft()
            self._cached_tokens -= len(old.tokens)
            self._evict(old)

    def _evict(self, added: _SharedChange) -> None:
        """Take a cached output out of the shared tree: what of it was indexed leaves (in
        pieces, as it entered); the rest never enters. Outputs can finish faster than a call's
        budget indexes them (64 sequences that accept 2 drafts a step add ~190 tokens a step
        to their own trees alone); then the oldest pending ones are dropped as they are
        evicted, so the backlog stays within the cache's size instead of growing with every
        request served."""
        if added.done < len(added.tokens):
            # Pending: the queue's head (the one in progress) or after it.
            self._shared_changes.remove(added)
        if added.done:
            self._shared_changes.append(_SharedChange(added.tokens[:added.done], -1))

    def shutdown(self) -> None:
        self._tracked.clear()
