"""Beam search as vLLM runs it: on top of generation, one token per step.

Each step runs every live beam for one token with its top `2 * beam_width` logprobs (the prefix
cache holds the beam's earlier tokens, so a step computes the last block's tokens only); each
candidate extends its beam by one token, a candidate ending in EOS is complete (unless
`ignore_eos`), and the `beam_width` best of the rest live on. After `max_tokens` steps (or when
no beam is left) the completed and live beams are ranked by vLLM's length-penalized score,
`cum_logprob / len(tokens) ** length_penalty` (the prompt's tokens counted, a final EOS not),
and the best `beam_width` returned. The search stops sooner when `beam_width` beams have
completed and no live one can still outscore them (`BeamSearch._settled`): the same answer, fewer
steps.

Torch-free and engine-free: the offline `LLM.beam_search` and the gateway's `use_beam_search`
drive the same `BeamSearch` with their own way of running a step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

# Candidates per beam are the top 2 * beam_width logprobs, and a request may ask for 20.
MAX_BEAM_WIDTH = 10


class BeamSearchParamsError(ValueError):
    """An invalid beam search parameter; the message names the field."""


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, validated at construction."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> BeamSearchParamsError:
            return BeamSearchParamsError(f"{name} must be {rule}, got {value!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise bad("beam_width", self.beam_width, f"an integer in [1, {MAX_BEAM_WIDTH}]")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "true or false")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or (name == "temperature" and value < 0):
                raise bad(name, value, "a finite number" + (" >= 0" if name == "temperature"
                                                            else ""))

    @property
    def num_candidates(self) -> int:
        """The logprobs a step asks for per beam."""
        return 2 * self.beam_width


@dataclass(slots=True)
class BeamSequence:
    """One hypothesis: the prompt's tokens then its own."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # each output token's
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    text: str = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    def extended(self, token_id: int, logprob: float) -> BeamSequence:
        return dataclasses.replace(self, tokens=[*self.tokens, token_id],
                                   cum_logprob=self.cum_logprob + logprob,
                                   logprobs=[*self.logprobs, logprob])


def beam_score(seq: BeamSequence, eos_token_ids: Collection[int], length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`."""
    length = len(seq.tokens) - (1 if seq.tokens[-1] in eos_token_ids else 0)
    return seq.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search: `beams` to run next, `expand` with their candidates, `results`."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: Collection[int], max_model_len: int | None = None) -> None:
        """`max_model_len`: the model's context, which caps `max_tokens` (a prompt that fills
        it is a BeamSearchParamsError)."""
        if not prompt_token_ids:
            raise BeamSearchParamsError("prompt must not be empty")
        if max_model_len is not None:
            room = max_model_len - len(prompt_token_ids)
            if room < 1:
                raise BeamSearchParamsError(f"prompt has {len(prompt_token_ids)} tokens; "
                                            f"max_model_len is {max_model_len}: no room for an "
                                            "output")
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        self.params = params
        self.eos = frozenset(eos_token_ids)
        self.beams = [BeamSequence(list(prompt_token_ids), len(prompt_token_ids))]
        self.completed: list[BeamSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens or self._settled()

    def _settled(self) -> bool:
        """No live beam can still reach the best `beam_width`: `beam_width` beams completed and
        none live can score above the worst of those however it goes on (its cum_logprob only
        falls; the length term at its most favourable: the longest a beam may get for a
        positive penalty, the current length for a negative one). Stopping then returns what
        running to `max_tokens` would."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        if len(self.completed) < width:
            return False
        kept = sorted((self._key(c) for c in self.completed), reverse=True)[width - 1]
        longest = self.beams[0].num_prompt_tokens + self.params.max_tokens if self.beams else 0
        for beam in self.beams:
            length = longest if penalty > 0 else len(beam.tokens)
            if beam.cum_logprob / length ** penalty > kept:
                return False
        return True

    def _key(self, seq: BeamSequence) -> float:
        return beam_score(seq, self.eos, self.params.length_penalty)

    def expand(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One step: `candidates[i]` are beam i's next tokens with their logprobs."""
        if len(candidates) != len(self.beams):
            raise ValueError(f"{len(candidates)} candidate lists for {len(self.beams)} beams")
        live: list[BeamSequence] = []
        for beam, options in zip(self.beams, candidates, strict=True):
            for token_id, logprob in options:
                if not math.isfinite(logprob):
                    continue  # a token the step could not produce (masked)
                seq = beam.extended(token_id, logprob)
                if token_id in self.eos and not self.params.ignore_eos:
                    seq.finish_reason = "stop"
                    self.completed.append(seq)
                else:
                    live.append(seq)
        live.sort(key=self._key, reverse=True)
        self.beams = live[:self.params.beam_width]
        self.steps += 1
        if self.steps >= self.params.max_tokens:
            for beam in self.beams:
                beam.finish_reason = "length"

    def results(self) -> list[BeamSequence]:
        """The best `beam_width` of the completed and live beams, best first."""
        ranked = sorted([*self.completed, *self.beams], key=self._key, reverse=True)
        return ranked[:self.params.beam_width]
