"""The log probabilities a request's outputs carry: its sampled tokens' (`TokenLogprob`) and
its prompt's (`PromptLogprobs`). Pure Python: the scheduler fills them, the services convert
them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    # 1-based rank of token_id in the model's distribution (1: the most likely); None: not
    # computed (sampled tokens' logprobs do not; prompt logprobs do, as vLLM reports them).
    rank: int | None = None


@dataclass(slots=True)
class PromptLogprobs:
    """A prompt's scored tokens (prompt tokens 1, 2, ...; the first has nothing before it),
    column by column: a long prompt's thousands of entries cost a few list operations, not an
    object each, on the engine thread and in the services (`PromptLogprobs` in the protos).
    `top_ids` / `top_logprobs` hold `num_top` entries per token, row after row."""

    num_top: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # 1-based rank in the distribution
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: PromptLogprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def entries(self) -> list[TokenLogprob]:
        """One `TokenLogprob` per scored token (the offline API's form)."""
        k = self.num_top
        return [TokenLogprob(t, lp, list(zip(self.top_ids[i * k:(i + 1) * k],
                                             self.top_logprobs[i * k:(i + 1) * k], strict=True)),
                             rank)
                for i, (t, lp, rank) in enumerate(zip(self.token_ids, self.logprobs, self.ranks,
                                                      strict=True))]
