"""Sampling from float32 logits: penalties, logit bias and allowed tokens, greedy, temperature,
top-k, top-p, min-p, per-request seeds, and top-n logprobs (from the raw model distribution, as
vLLM reports them).

Seeded requests draw from their own generator, so a request's samples do not depend on what it
is batched with.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.bad_words import banned_tokens, reads_output
from engine.devices import to_device
from engine.logprobs import TokenLogprob
from engine.penalties import PenaltyState
from engine.request import Request
from engine.structured import fill_masks
from engine_api.sampling_params import SamplingParams

# Greedy decoding's argmax in two levels. One `[N, V]` row reduced by one torch kernel is one
# thread block streaming V floats: 27 us per step for V = 128,256 on the H200, against ~10 us
# for the rest of the sampler (bench/results/h200/probe_bs1_598a328.json). Viewed as
# `[N, V / C, C]`, the first level runs N * V / C blocks.
_ARGMAX_CHUNKS = (1024, 512, 2048, 256)


@functools.lru_cache(maxsize=64)
def _argmax_chunk(vocab: int) -> int:
    """The first candidate chunk that divides `vocab` into at least 16 chunks, else 0."""
    return next((c for c in _ARGMAX_CHUNKS if vocab % c == 0 and vocab // c >= 16), 0)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for `[N, V]` logits, including its tie rule (the first maximal
    index) and NaN rule (NaN wins): each chunk's first maximum, then the first chunk holding
    the row's maximum."""
    n, vocab = logits.shape
    chunk = _argmax_chunk(vocab)
    if chunk == 0 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    values, idx = logits.view(n, vocab // chunk, chunk).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)  # [N, 1]
    return (best * chunk + idx.gather(1, best)).squeeze(1)


@dataclass(slots=True)
class ShapingTensors:
    """A request's logit bias (ids, values) and allowed ids on one device; None where unset."""

    device: torch.device
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    allowed_ids: torch.Tensor | None


def shaping_tensors(req: Request, device: torch.device) -> ShapingTensors:
    """The request's `ShapingTensors` on `device`, made once (its lists can be long)."""
    cached = req.shaping_tensors
    if isinstance(cached, ShapingTensors) and cached.device == device:
        return cached
    sp = req.sampling_params
    bias = sp.logit_bias
    made = ShapingTensors(
        device,
        to_device(list(bias), torch.long, device) if bias else None,
        to_device(list(bias.values()), torch.float32, device) if bias else None,
        (to_device(sp.allowed_token_ids, torch.long, device)
         if sp.allowed_token_ids is not None else None))
    req.shaping_tensors = made
    return made


def shape_logits(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """`logit_bias` added and tokens outside `allowed_token_ids` masked, for the rows whose
    requests ask (ids are checked against the vocabulary when a request is added): the rows'
    cached id tensors concatenated, then one scatter for each kind, with no host sync.
    logits: [N, V], modified in place and returned."""
    dev = logits.device
    bias_rows: list[int] = []
    bias_counts: list[int] = []
    bias_ids: list[torch.Tensor] = []
    bias_values: list[torch.Tensor] = []
    allow_rows: list[int] = []
    allow_counts: list[int] = []
    allow_ids: list[torch.Tensor] = []
    for i, req in enumerate(reqs):
        sp = req.sampling_params
        if not sp.shapes_logits:
            continue
        t = shaping_tensors(req, dev)
        if t.bias_ids is not None and t.bias_values is not None:
            bias_rows.append(i)
            bias_counts.append(len(sp.logit_bias))
            bias_ids.append(t.bias_ids)
            bias_values.append(t.bias_values)
        if t.allowed_ids is not None:
            allow_rows.append(i)
            allow_counts.append(len(t.allowed_ids))
            allow_ids.append(t.allowed_ids)
    if allow_rows:
        rows = _rows(allow_rows, allow_counts, dev)
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[rows, torch.cat(allow_ids)] = True
        limited = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev)
        limited[to_device(allow_rows, torch.long, dev)] = True
        logits.masked_fill_(limited[:, None] & ~allowed, float("-inf"))
    if bias_rows:
        logits.index_put_((_rows(bias_rows, bias_counts, dev), torch.cat(bias_ids)),
                          torch.cat(bias_values).to(logits.dtype), accumulate=True)
    return logits


def _rows(rows: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
    """Row i repeated counts[i] times, on the device (its size given: no sync)."""
    return torch.repeat_interleave(to_device(rows, torch.long, device),
                                   to_device(counts, torch.long, device),
                                   output_size=sum(counts))


def mask_logits(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Structured outputs (engine/structured.py): tokens the rows' grammars do not allow next
    set to -inf, for the rows whose requests
    have a grammar (the others untouched). One host bitmask for those rows, copied without a
    sync, unpacked and applied on the device. logits: [N, V], modified in place and returned."""
    # A request that finished in the previous step (its grammar terminated) may be in this one
    # under async scheduling; its token is dropped, so its row stays as it is.
    # A grammar whose request is still reasoning leaves its row free.
    rows = [i for i, r in enumerate(reqs)
            if r.grammar is not None and r.grammar.active and not r.is_finished]
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    fill_masks([g for i in rows if (g := reqs[i].grammar) is not None], bitmask)
    dev = logits.device
    if dev.type == "cuda":  # from pinned memory: queued, no sync (see `to_device`)
        bitmask = bitmask.pin_memory().to(dev, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().view(len(rows), words * 32)[:, :vocab]
    idx = to_device(rows, torch.long, dev)
    sub = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, idx, sub)


def _needs_min_tokens_mask(req: Request) -> bool:
    return req.num_output_tokens < req.sampling_params.min_tokens


def _ban(logits: torch.Tensor, banned: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
    """Set the tokens each (row, ids) names to -inf (ids outside the vocabulary skipped): one
    index_put for all rows, its indices copied without a blocking copy (`to_device`).
    logits: [N, V], modified in place and returned."""
    vocab = logits.shape[1]
    rows: list[int] = []
    ids: list[int] = []
    for i, tokens in banned:
        for t in tokens:
            if 0 <= t < vocab:
                rows.append(i)
                ids.append(t)
    if rows:
        dev = logits.device
        index = (to_device(rows, torch.long, dev), to_device(ids, torch.long, dev))
        logits.index_put_(index, logits.new_full((), float("-inf")))  # a fill, not a copy
    return logits


def mask_min_tokens(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Before `min_tokens` outputs exist, EOS (unless ignore_eos) and stop_token_ids cannot be
    sampled (vLLM / HF `min_new_tokens` semantics). logits: [N, V], modified in place."""
    return _ban(logits, [
        (i, sorted(set(r.sampling_params.stop_token_ids)
                   | (set() if r.sampling_params.ignore_eos else set(r.eos_token_ids))))
        for i, r in enumerate(reqs) if _needs_min_tokens_mask(r)])


def mask_bad_words(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """`bad_words` (engine/bad_words.py): each row's banned next tokens to -inf.
    logits: [N, V], modified in place."""
    return _ban(logits, [(i, banned_tokens(r)) for i, r in enumerate(reqs)
                         if r.bad_words_token_ids and not r.is_finished])


def filter_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on rows that sample randomly → probabilities [N, V]."""
    dev = logits.device
    temps = to_device([p.temperature for p in params], torch.float32, dev)
    logits = logits / temps[:, None]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, _ = logits.sort(dim=-1, descending=True)
        if any(k > 0 for k in top_k):
            ks = to_device([k if k > 0 else logits.shape[1] for k in top_k], torch.long, dev)
            kth = sorted_logits.gather(1, (ks.clamp(max=logits.shape[1]) - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if any(p < 1.0 for p in top_p):
            ps = to_device(top_p, torch.float32, dev)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            cutoff_idx = (mass_before < ps[:, None]).sum(dim=-1, keepdim=True) - 1
            cutoff = sorted_logits.gather(1, cutoff_idx.clamp(min=0))
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = logits.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        mp = to_device(min_p, torch.float32, dev)
        thresh = probs.max(dim=-1, keepdim=True).values * mp[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def request_generator(req: Request, device: torch.device) -> torch.Generator | None:
    """The seeded request's own generator (made on first use), None for an unseeded one."""
    seed = req.sampling_params.seed
    if seed is None:
        return None
    if req.generator is None:
        req.generator = torch.Generator(device=device).manual_seed(seed)
    assert isinstance(req.generator, torch.Generator)
    return req.generator


def draw_tokens(probs: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Exponential-race sampling (argmax p/q, q ~ Exp(1)) with per-request generators; `reqs`
    names each row's request (a request may own several rows: speculative verification)."""
    q = torch.empty_like(probs).exponential_()  # unseeded rows: one draw for all
    for i, req in enumerate(reqs):
        gen = request_generator(req, probs.device)
        if gen is not None:
            q[i].exponential_(generator=gen)
    return (probs / q).argmax(dim=-1)


@dataclass(slots=True)
class _LogprobTensors:
    chosen: torch.Tensor            # [N] log-probability of each sampled token
    top_vals: torch.Tensor | None   # [N, max_n]
    top_ids: torch.Tensor | None


def _logprob_tensors(raw_logits: torch.Tensor, tokens: torch.Tensor, reqs: Sequence[Request]
                     ) -> _LogprobTensors | None:
    want = [r.sampling_params.logprobs for r in reqs]
    if all(w is None for w in want):
        return None
    logp = raw_logits.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    max_n = max(w or 0 for w in want)
    if max_n == 0:
        return _LogprobTensors(chosen, None, None)
    top_vals, top_ids = logp.topk(max_n, dim=-1)
    return _LogprobTensors(chosen, top_vals, top_ids)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Start a device-to-host copy without waiting (pinned destination on CUDA)."""
    return t.to("cpu", non_blocking=True)


def copies_queued(t: torch.Tensor) -> torch.cuda.Event | None:
    """An event recorded after the device-to-host copies just queued from `t`'s stream (None
    on the CPU, where they are done): a pending result waits on it, not on the whole device."""
    if not t.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class PendingTokens:
    """Sampled tokens (and logprobs) still on their way to the host.

    `tokens` stays on the device (the next step's inputs under async scheduling); `result()`
    waits for the copies: the step's one device-to-host sync."""

    def __init__(self, reqs: Sequence[Request], tokens: torch.Tensor,
                 logprobs: _LogprobTensors | None, probs: torch.Tensor | None = None) -> None:
        self.reqs = list(reqs)
        self.tokens = tokens
        # [N, V] float32 on the device when asked for (`Sampler.sample(keep_probs=True)`): the
        # distribution each token was drawn from (one-hot for greedy rows).
        self.probs = probs
        self._tokens_host = to_host(tokens)
        self._lp = None if logprobs is None else _LogprobTensors(
            to_host(logprobs.chosen),
            None if logprobs.top_vals is None else to_host(logprobs.top_vals),
            None if logprobs.top_ids is None else to_host(logprobs.top_ids))
        self._event = copies_queued(tokens)

    def result(self) -> tuple[list[int], list[TokenLogprob | None]]:
        if self._event is not None:
            self._event.synchronize()
        tok_list: list[int] = self._tokens_host.tolist()
        if self._lp is None:
            return tok_list, [None] * len(self.reqs)
        chosen = self._lp.chosen.tolist()
        out: list[TokenLogprob | None] = []
        for i, req in enumerate(self.reqs):
            w = req.sampling_params.logprobs
            if w is None:
                out.append(None)
                continue
            top: list[tuple[int, float]] = []
            if w > 0 and self._lp.top_vals is not None and self._lp.top_ids is not None:
                top = list(zip(self._lp.top_ids[i, :w].tolist(),
                               self._lp.top_vals[i, :w].tolist(), strict=True))
            out.append(TokenLogprob(tok_list[i], chosen[i], top))
        return tok_list, out


def depends_on_outputs(req: Request) -> bool:
    """Whether sampling reads the request's own output history (penalties, min_tokens): such a
    request's next token cannot be sampled before its last one reached the host (under async
    scheduling the runner settles the previous step first: `ModelRunner.launch`)."""
    sp = req.sampling_params
    return sp.has_penalties or sp.min_tokens > 0 or reads_output(req)


class Sampler:
    def __init__(self, penalty_capacity: int | None = None) -> None:
        """penalty_capacity: most requests whose penalty history stays on the device at once
        (the runner's max_num_seqs, whose memory it keeps out of the KV cache); None: any."""
        self._penalty_capacity = penalty_capacity
        self._penalties: PenaltyState | None = None

    def _penalty_state(self, logits: torch.Tensor) -> PenaltyState:
        state = self._penalties
        if state is None or state.vocab != logits.shape[1] or state.device != logits.device:
            state = self._penalties = PenaltyState(logits.shape[1], logits.device,
                                                   self._penalty_capacity)
        return state

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request],
               keep_probs: bool = False) -> PendingTokens:
        """logits: [N, V], one row per request → tokens on the device, copies started.

        Any float dtype: an all-greedy batch without penalties, bias, allow-lists, min_tokens,
        bad words, grammars or logprobs takes its argmax on the logits as given (exact: widening is monotonic);
        anything else first widens them to float32. `keep_probs`: also keep the distribution
        each token was drawn from (a draft model's q for the rejection sampler)."""
        greedy: list[bool] = []
        penalties = shaped = min_tokens = logprobs = constrained = banned = False
        for r in reqs:  # one pass: this runs once per step over the whole batch
            sp = r.sampling_params
            greedy.append(sp.greedy)
            penalties = penalties or sp.has_penalties
            shaped = shaped or sp.shapes_logits
            constrained = constrained or (r.grammar is not None and r.grammar.active)
            min_tokens = min_tokens or _needs_min_tokens_mask(r)
            banned = banned or bool(r.bad_words_token_ids)
            logprobs = logprobs or sp.logprobs is not None
        if logits.dtype != torch.float32 and (penalties or shaped or min_tokens or logprobs
                                              or constrained or banned or not all(greedy)):
            logits = logits.float()
        raw = logits
        if penalties:
            logits = self._penalty_state(logits).apply(logits.clone(), reqs)
        if shaped:
            logits = shape_logits(logits.clone() if logits is raw else logits, reqs)
        if min_tokens:
            logits = mask_min_tokens(logits.clone() if logits is raw else logits, reqs)
        if banned:
            logits = mask_bad_words(logits.clone() if logits is raw else logits, reqs)
        if constrained:  # last: a bias must not lift a token the grammar forbids
            logits = mask_logits(logits.clone() if logits is raw else logits, reqs)
        kept = None
        if not any(greedy):  # every row draws: no argmax, no row selection
            probs = filter_probs(logits, [r.sampling_params for r in reqs])
            tokens = draw_tokens(probs, reqs)
            kept = probs if keep_probs else None
        else:
            tokens = argmax_rows(logits)
            if keep_probs:  # a greedy row's token was drawn from a one-hot distribution
                kept = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
                kept.scatter_(1, tokens[:, None], 1.0)
            if not all(greedy):
                rows = [i for i, g in enumerate(greedy) if not g]
                idx = to_device(rows, torch.long, logits.device)
                sub = [reqs[i] for i in rows]
                probs = filter_probs(logits.index_select(0, idx), [r.sampling_params for r in sub])
                tokens.index_copy_(0, idx, draw_tokens(probs, sub))
                if kept is not None:
                    kept.index_copy_(0, idx, probs)
        return PendingTokens(reqs, tokens, _logprob_tensors(raw, tokens, reqs), kept)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]
                 ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [N, V], one row per request → (token ids, logprobs)."""
        return self.sample(logits, reqs).result()
