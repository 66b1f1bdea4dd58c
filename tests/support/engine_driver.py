"""Driving engines over the tiny models in tests: `tiny_llm` (a float32 CPU engine with small
blocks), a scheduler-level driver that records every position's logits (`Trace`, `drive`,
`run_to_end`), the torch-vs-Triton backend comparison, the quantized-cache accuracy check and
a step-by-step driver (`run_steps`)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.attention.forward_context import AttentionMetadata
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import StepOutput
from engine.request import Request
from engine.scheduler import SampledToken
from engine_api.request_options import RequestOptions
from engine_api.sampling_params import SamplingParams


def tiny_llm(path: Path, **kwargs: Any) -> LLM:
    """An engine over a tiny HF dir: float32 on the CPU, 4-token blocks (many per sequence)."""
    opts: dict[str, Any] = dict(dtype="float32", block_size=4, device="cpu", max_num_seqs=32)
    opts.update(kwargs)
    return LLM(model=str(path), **opts)



def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---- a scheduler-level driver that keeps every position's logits -------------------------------

@dataclass
class Trace:
    """What one request saw: logits of each position it computed (last computation wins)."""

    request: Request
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [V]

    def logits_matrix(self, start: int = 0) -> torch.Tensor:
        """[L - start, V] logits of positions start..L-1, L = prompt + outputs - 1 (the last
        sampled token is never fed back). Positions before `start` may come from the prefix cache."""
        n = self.request.num_tokens - 1
        missing = [p for p in range(start, n) if p not in self.logits]
        assert not missing, f"{self.request.request_id}: positions never computed: {missing}"
        return torch.stack([self.logits[p] for p in range(start, n)])


def drive(engine: LLMEngine, traces: dict[str, Trace] | None = None) -> Iterator[dict[str, Trace]]:
    """Run the engine's scheduler to completion with greedy sampling, recording every logit row.

    Uses `scheduler.schedule()` + `runner.logits_for(out)` (the same input preparation and forward
    as `runner.execute`) so each prefill chunk's and each decode step's logits can be compared
    with the reference. Yields the traces after every step (so callers can inspect mid-flight).
    """
    sched = engine.scheduler
    traces = {} if traces is None else traces
    for req in list(sched.requests.values()):
        traces.setdefault(req.request_id, Trace(req))
    while sched.has_work():
        out = sched.schedule()
        assert not out.is_empty, "scheduler made no progress"
        logits = engine.runner.logits_for(out)  # [T, V]
        row = 0
        sampled: dict[str, SampledToken] = {}
        for s in out.scheduled:
            tr = traces.setdefault(s.request.request_id, Trace(s.request))
            for j in range(s.num_new_tokens):
                tr.logits[s.num_computed_tokens + j] = logits[row + j].clone()
            row += s.num_new_tokens
            if s.sample:
                sampled[s.request.request_id] = SampledToken(int(logits[row - 1].argmax()))
        assert row == logits.shape[0]
        sched.update_from_output(out, sampled)
        sched.check_integrity()
        yield traces


def run_to_end(engine: LLMEngine) -> dict[str, Trace]:
    """`drive` until no work is left; the traces of every request seen."""
    traces: dict[str, Trace] = {}
    for _ in drive(engine, traces):
        pass
    return traces


def traces_by_backend(path: Path, prompts: dict[str, list[int]], max_tokens: int = 3,
                      **kwargs: Any) -> dict[str, dict[str, Trace]]:
    """backend ("torch", "triton") -> every request's trace: `prompts` run greedily on an
    engine of each attention backend (the Triton one under the interpreter on the CPU)."""
    out: dict[str, dict[str, Trace]] = {}
    for backend in ("torch", "triton"):
        llm = tiny_llm(path, attention_backend=backend, **kwargs)
        for rid, prompt in prompts.items():
            llm.engine.add_request(rid, prompt, greedy(max_tokens))
        out[backend] = run_to_end(llm.engine)
    return out


def assert_backends_agree(traces: dict[str, dict[str, Trace]], tol: float,
                          same_tokens: bool = False) -> None:
    """`traces_by_backend`'s two engines computed the same logits (within `tol`) for every
    request, from the same first computed position (a prefix hit's tail on both); with
    `same_tokens`, sampled the same tokens too."""
    for rid, want in traces["torch"].items():
        got = traces["triton"][rid]
        start = min(got.logits)
        assert start == min(want.logits), rid
        torch.testing.assert_close(got.logits_matrix(start), want.logits_matrix(start),
                                   atol=tol, rtol=tol, msg=rid)
        if same_tokens:
            assert got.request.output_token_ids == want.request.output_token_ids, rid


# Prompts of the quantized-cache accuracy tests (fp8 and int8 KV against the float32 cache).
AGREEMENT_TEXTS = ("The capital of France is", "def fibonacci(n):",
                   "Once upon a time, there was a", "The three primary colors are",
                   "In machine learning, overfitting means")


# The reference engines' greedy continuations of AGREEMENT_TEXTS, by max_tokens: the fp8 and
# int8 tests both compare with the session's SmolLM2 engine, which answers the same each time.
_continuations: weakref.WeakKeyDictionary[LLM, dict[int, list[tuple[list[int], list[int]]]]] = (
    weakref.WeakKeyDictionary())


def _greedy_continuations(reference: LLM, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy output) of each of AGREEMENT_TEXTS on `reference`, computed once."""
    by_length = _continuations.setdefault(reference, {})
    if max_tokens not in by_length:
        tok = reference.engine.tokenizer
        assert tok is not None
        prompts = [tok.encode(t) for t in AGREEMENT_TEXTS]
        outs = reference.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens))
        by_length[max_tokens] = [(prompt, list(res.outputs[0].token_ids))
                                 for prompt, res in zip(prompts, outs, strict=True)]
    return by_length[max_tokens]


def teacher_forced_agreement(reference: LLM, candidate: LLM, max_tokens: int = 24
                             ) -> tuple[int, int]:
    """`reference`'s greedy continuation of AGREEMENT_TEXTS, fed whole to `candidate`: at how
    many of its positions `candidate`'s argmax is the reference's token (agreeing, total)."""
    agree = total = 0
    for i, (prompt, out) in enumerate(_greedy_continuations(reference, max_tokens)):
        candidate.engine.add_request(f"t{i}", prompt + out[:-1], greedy(1))
        trace = run_to_end(candidate.engine)[f"t{i}"]
        argmax = trace.logits_matrix()[len(prompt) - 1:].argmax(-1)
        agree += int((argmax == torch.tensor(out)).sum())
        total += len(out)
    return agree, total


def mixed_step_metadata(block_size: int = 4) -> AttentionMetadata:
    """A mixed step for the quantized-cache backend tests: one decode (6 tokens) and one 5-token
    prefill chunk over a cached 4-token prefix (9 tokens); block tables [[5, 2, 0], [1, 7, 3]],
    the chunk's K/V written to block 7 and block 3."""
    bs = block_size
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 6], dtype=torch.int32),
        seq_lens=torch.tensor([6, 9], dtype=torch.int32),
        block_tables=torch.tensor([[5, 2, 0], [1, 7, 3]], dtype=torch.int32),
        slot_mapping=torch.tensor([2 * bs + 1, 3 * bs + 0] + [7 * bs + i for i in range(4)]),
        num_decodes=1, max_query_len=5, max_seq_len=9,
        query_start_loc_cpu=[0, 1, 6], seq_lens_cpu=[6, 9])


# ---- driving an engine step by step --------------------------------------------------------

def run_steps(llm: LLM, prompts: Sequence[list[int]],
              params: Sequence[SamplingParams | RequestOptions],
              abort_after: dict[str, int] | None = None, max_steps: int = 1000, **add: Any
              ) -> tuple[dict[str, list[StepOutput]], int]:
    """Add requests r0, r1, ... and step the engine until none is left; returns every
    request's step outputs and the step count. `abort_after`: request id -> abort once it has
    that many outputs. `add`: more `add_request` keywords. Checks that no KV block leaked."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp, **add)
    outs: dict[str, list[StepOutput]] = {f"r{i}": [] for i in range(len(params))}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].append(o)
            if abort_after and len(outs[o.request_id]) == abort_after.get(o.request_id):
                eng.abort_request(o.request_id)
        steps += 1
        assert steps < max_steps
    eng.scheduler.check_integrity()
    assert not eng.kv.req_to_blocks, "blocks still held after every request ended"
    return outs, steps


def step_tokens(outs: dict[str, list[StepOutput]]) -> dict[str, list[int]]:
    """Each request's output tokens, from `run_steps`' outputs."""
    return {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()}
