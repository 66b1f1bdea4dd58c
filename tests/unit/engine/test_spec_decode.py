"""Speculative decoding: the n-gram proposer, the rejection sampler (greedy exactness and the
target distribution kept under random sampling), and the engine's verify step: the same
tokens as plain decoding whatever the drafts, stops inside accepted drafts, async scheduling,
preemption, and no leaked KV blocks.

The tiny float32 Llama on the CPU is deterministic, so speculative and plain greedy decoding
must agree token for token; drafts that are all right ("oracle": the plain run's own tokens)
and all wrong exercise both ends of acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError, SpeculativeConfig
from engine.outputs import StepOutput
from engine.piecewise_graphs import PiecewiseGraphRunner
from engine.request import Request
from engine.sampler import filter_probs
from engine.spec import SequenceProposer
from engine.spec.ngram import NgramProposer
from engine.spec.rejection import verify
from engine_api.errors import EngineInputError
from engine_api.request_options import RequestOptions
from tests.support.engine_driver import run_steps, step_tokens, tiny_llm

# No step budget (engine/spec/budget.py): the drafts asserted on must not follow the shared
# machine's timing.
NGRAM: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4, "step_budget": False}
NGRAM_FLOOR = SpeculativeConfig().min_accepted_per_step
# Prompts with loops in them (the proposer finds matches), and plain ones.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],
    [(7 * j) % 250 + 1 for j in range(23)],
    [9, 9, 9, 9, 9, 9],
    [(3 * j * j + 1) % 200 + 1 for j in range(40)],
    [11, 12, 13, 11, 12],
]


# ---- the n-gram proposer -------------------------------------------------------------------

def test_ngram_prefers_the_longest_suffix_and_its_latest_occurrence() -> None:
    p = NgramProposer(1, 3)
    # Suffix [2, 3] occurs at 1 (followed by 4) and at 6 (followed by 9); [1, 2, 3] only at 0.
    assert p.propose([1, 2, 3, 4, 0, 0, 2, 3, 9, 1, 2, 3], 2) == [4, 0]
    # Without the 3-gram the latest 2-gram wins.
    assert p.propose([7, 2, 3, 4, 0, 0, 2, 3, 9, 8, 2, 3], 2) == [9, 8]
    # Only a 1-gram recurs.
    assert p.propose([4, 1, 5, 6, 4], 3) == [1, 5, 6]


def test_ngram_continues_a_loop_past_the_sequence_end() -> None:
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert p.propose([3, 3, 3], 4) == [3, 3, 3, 3]


def test_ngram_respects_min_n_and_k() -> None:
    p = NgramProposer(2, 3)
    assert p.propose([4, 1, 5, 6, 4], 3) == []      # only a 1-gram recurs
    assert p.propose([1, 2, 3, 1, 2], 0) == []
    assert p.propose([1, 2, 3, 1, 2], 1) == [3]
    assert p.propose([1], 3) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


# ---- the rejection sampler -----------------------------------------------------------------

def _reqs(n: int, params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", [1], params) for i in range(n)]


def test_greedy_verify_accepts_the_argmax_prefix_then_emits_the_argmax() -> None:
    logits = torch.full((7, 10), -5.0)
    argmax = [3, 4, 5, 6, 1, 2, 8]
    logits[torch.arange(7), argmax] = 5.0
    reqs = _reqs(3, SamplingParams(temperature=0))
    # r0: drafts [3, 4, 9] on rows 0-3 → 3, 4 accepted, 9 rejected → 3, 4, then row 2's 5.
    # r1: no drafts → its one row's argmax (1). r2: [2] accepted → then bonus row 6's 8.
    drafts: list[Sequence[int]] = [[3, 4, 9], [], [2]]
    assert verify(logits, reqs, drafts).result() == [[3, 4, 5], [1], [2, 8]]


def _empirical(tokens: list[int], vocab: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    return counts / counts.sum()


@pytest.mark.parametrize("draft_token", [0, 3, 5])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=3)])
def test_random_verify_keeps_the_target_distribution(draft_token: int,
                                                     params: SamplingParams) -> None:
    """First emitted token ~ p whatever the draft (a likely one, an unlikely one, one outside
    top-k); given the draft was accepted, the bonus token ~ the bonus row's p."""
    torch.manual_seed(0)
    vocab, n = 6, 30_000
    first = torch.tensor([2.0, 0.5, 1.5, -1.0, 0.0, 1.0])
    bonus = torch.tensor([0.0, 1.0, 2.0, 0.5, -0.5, 1.5])
    logits = torch.stack([first, bonus]).repeat(n, 1)
    out = verify(logits, _reqs(n, params), [[draft_token]] * n).result()
    p_first = filter_probs(first[None].clone(), [params])[0].double()
    p_bonus = filter_probs(bonus[None].clone(), [params])[0].double()
    got_first = _empirical([o[0] for o in out], vocab)
    # 30k draws: each probability's standard error is below 0.003; 0.015 is ~5 of them.
    assert (got_first - p_first).abs().max() < 0.015, (got_first, p_first)
    accepted = [o for o in out if len(o) == 2]
    assert all(o[0] == draft_token for o in accepted)
    assert abs(len(accepted) / n - float(p_first[draft_token])) < 0.015
    if len(accepted) > 2_000:
        got_bonus = _empirical([o[1] for o in accepted], vocab)
        assert (got_bonus - p_bonus).abs().max() < 0.035, (got_bonus, p_bonus)


def test_random_verify_with_draft_probabilities_keeps_the_target_distribution() -> None:
    """The draft-model seam: drafts sampled from q, accepted with min(1, p/q)."""
    torch.manual_seed(1)
    vocab, n = 5, 30_000
    params = SamplingParams(temperature=1.0)
    target = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5])
    q = torch.tensor([0.1, 0.5, 0.1, 0.2, 0.1])
    drafts = torch.multinomial(q, n, replacement=True).tolist()
    logits = torch.stack([target, target]).repeat(n, 1)
    draft_probs = torch.stack([q, torch.zeros(vocab)]).repeat(n, 1)
    out = verify(logits, _reqs(n, params), [[d] for d in drafts], draft_probs).result()
    p = target.softmax(0).double()
    got = _empirical([o[0] for o in out], vocab)
    assert (got - p).abs().max() < 0.015, (got, p)


def test_seeded_verify_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(4 * 3, 50, generator=torch.Generator().manual_seed(3))
    a = verify(logits, _reqs(4, params), [[1, 2]] * 4).result()
    b = verify(logits, _reqs(4, params), [[1, 2]] * 4).result()
    assert a == b


def test_verify_checks_the_row_count() -> None:
    with pytest.raises(ValueError, match="logits rows"):
        verify(torch.zeros(3, 8), _reqs(1, SamplingParams(temperature=0)), [[1]])


# ---- the engine ----------------------------------------------------------------------------

def _run(llm: LLM, params: Sequence[SamplingParams | RequestOptions], prompts: Sequence[list[int]] = PROMPTS,
         **add: Any) -> tuple[dict[str, list[StepOutput]], int]:
    return run_steps(llm, prompts, params, **add)


_tokens = step_tokens


def _greedy(*lengths: int, **kw: Any) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw) for n in lengths]


class _ScriptedProposer(SequenceProposer):
    """Drafts from a known continuation of each prompt (the plain run's output), wrong from
    the `wrong_from`-th draft on (None: never): a test input that fixes how many are accepted."""

    def __init__(self, prompts: Sequence[list[int]], outputs: Sequence[list[int]],
                 wrong_from: int | None = None) -> None:
        self.full = [p + o for p, o in zip(prompts, outputs, strict=True)]
        self.wrong_from = wrong_from

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for seq in self.full:
            if seq[:len(token_ids)] == token_ids:
                nxt = seq[len(token_ids):len(token_ids) + k]
                if self.wrong_from is None:
                    return nxt
                return [t if j < self.wrong_from else (t + 1) % 200 for j, t in enumerate(nxt)]
        return []


def _spec_llm(path: Path, padded: bool = False, **kwargs: Any) -> LLM:
    """An engine that speculates; `padded` lays verify steps out as the CUDA verify graphs
    replay them (1 + 4 rows per sequence, padding rows after the drafts), run eagerly here."""
    llm = tiny_llm(path, speculative_config=NGRAM, **kwargs)
    if padded:
        llm.engine.runner.verify_q_len = 1 + NGRAM["num_speculative_tokens"]
    return llm


@pytest.fixture(scope="module")
def plain(tiny_model_dirs: dict[str, Path]) -> dict[str, list[int]]:
    outs, _ = _run(tiny_llm(tiny_model_dirs["llama"]), _greedy(24, 17, 30, 9, 21))
    return _tokens(outs)


def test_ngram_greedy_matches_plain_decoding(tiny_model_dirs: dict[str, Path],
                                             plain: dict[str, list[int]]) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=NGRAM)
    outs, _ = _run(llm, _greedy(24, 17, 30, 9, 21))
    assert _tokens(outs) == plain
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 0  # the loops in the prompts were found and verified
    assert 0 <= sched.num_accepted_tokens <= sched.num_draft_tokens


@pytest.mark.parametrize("padded", [False, True])
def test_verify_steps_through_piecewise_pieces_match_plain_decoding(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]], padded: bool) -> None:
    """Verify steps that no verify graph takes run through the piecewise graphs' pieces (here
    uncaptured, on the CPU): ragged, and laid out as the verify graphs lay them out."""
    llm = _spec_llm(tiny_model_dirs["llama"], padded)
    runner = llm.engine.runner
    pieces = runner.piecewise = PiecewiseGraphRunner(runner, 128, capture=False)
    outs, steps = _run(llm, _greedy(24, 17, 30, 9, 21))
    assert _tokens(outs) == plain
    assert llm.engine.scheduler.num_draft_tokens > 0
    assert pieces.num_steps == steps  # every step fits 128 tokens
    assert (runner.num_uniform_verify_steps > 0) == padded
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("wrong_from", [None, 0, 2])
def test_scripted_drafts_accepted_up_to_the_first_wrong_one(tiny_model_dirs: dict[str, Path],
                                                            plain: dict[str, list[int]],
                                                            wrong_from: int | None,
                                                            padded: bool) -> None:
    llm = _spec_llm(tiny_model_dirs["llama"], padded)
    llm.engine.proposer = _ScriptedProposer(
        PROMPTS, [plain[f"r{i}"] for i in range(len(PROMPTS))], wrong_from=wrong_from)
    outs, steps = _run(llm, _greedy(24, 17, 30, 9, 21))
    assert _tokens(outs) == plain
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 0
    assert (llm.engine.runner.num_uniform_verify_steps > 0) == padded
    if wrong_from == 0:
        assert sched.num_accepted_tokens == 0
        assert steps >= 30  # one token per step, as without drafts
    elif wrong_from == 2:
        # Two accepted per step where 4 were drafted (fewer near max_tokens).
        assert 0.4 < sched.num_accepted_tokens / sched.num_draft_tokens <= 0.6
        assert max(len(o.new_token_ids) for os in outs.values() for o in os) == 3
    else:
        assert sched.num_accepted_tokens == sched.num_draft_tokens
        # 4 drafts + 1 per step after the first token: 30 tokens in ~1 + 29 / 5 steps.
        assert steps <= 10
        assert max(len(o.new_token_ids) for os in outs.values() for o in os) == 5


def test_stops_inside_accepted_drafts_end_where_plain_decoding_ends(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]]) -> None:
    stop_tok = plain["r2"][6]  # r2 stops at its 7th token (or earlier if it occurs sooner)
    params = [*_greedy(24, 17), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                               stop_token_ids=[stop_tok]), *_greedy(9, 3)]
    want, _ = _run(tiny_llm(tiny_model_dirs["llama"]), params)
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=NGRAM)
    llm.engine.proposer = _ScriptedProposer(
        PROMPTS, [plain[f"r{i}"] for i in range(len(PROMPTS))])
    got, _ = _run(llm, params)
    assert _tokens(got) == _tokens(want)
    assert _tokens(got)["r2"][-1] == stop_tok and len(_tokens(got)["r4"]) == 3
    assert [o[-1].finish_reason for o in got.values()] == [o[-1].finish_reason
                                                           for o in want.values()]


@pytest.mark.parametrize("padded", [False, True])
def test_speculation_with_async_scheduling_and_preemption(tiny_model_dirs: dict[str, Path],
                                                          plain: dict[str, list[int]],
                                                          padded: bool) -> None:
    # 24 blocks of 4 tokens cannot hold all five sequences: later ones get preempted.
    params = _greedy(24, 17, 30, 9, 21)
    llm = _spec_llm(tiny_model_dirs["llama"], padded, async_scheduling=True, num_gpu_blocks=24)
    got, _ = _run(llm, params)
    assert _tokens(got) == plain
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.num_draft_tokens > 0
    assert (llm.engine.runner.num_uniform_verify_steps > 0) == padded


def test_random_sampling_with_speculation_frees_everything(
        tiny_model_dirs: dict[str, Path]) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=NGRAM)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(len(PROMPTS))]
    a, _ = _run(llm, params)
    assert all(len(t) == 20 for t in _tokens(a).values())
    b, _ = _run(tiny_llm(tiny_model_dirs["llama"], speculative_config=NGRAM), params)
    assert _tokens(a) == _tokens(b)  # seeded: reproducible with speculation too


def test_per_request_caps_and_ineligible_sampling(tiny_model_dirs: dict[str, Path]) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=NGRAM)
    eng = llm.engine
    assert eng.add_request("a", [1, 2], _greedy(4)[0]).num_speculative_tokens == 4
    assert eng.add_request("b", [1, 2], _greedy(4)[0],
                           num_speculative_tokens=2).num_speculative_tokens == 2
    assert eng.add_request("c", [1, 2], _greedy(4)[0],
                           num_speculative_tokens=9).num_speculative_tokens == 4
    assert eng.add_request("d", [1, 2], _greedy(4)[0],
                           num_speculative_tokens=0).num_speculative_tokens == 0
    ineligible: list[dict[str, Any]] = [{"logprobs": 1}, {"repetition_penalty": 1.2},
                                        {"min_tokens": 2}, {"logit_bias": {3: 1.0}},
                                        {"allowed_token_ids": [1, 2]}]
    for i, kw in enumerate(ineligible):
        req = eng.add_request(f"x{i}", [1, 2], _greedy(4, **kw)[0])
        assert req.num_speculative_tokens == 0
    with pytest.raises(EngineInputError, match="num_speculative_tokens"):
        eng.add_request("e", [1, 2], _greedy(4)[0], num_speculative_tokens=-1)
    # Without the capability a request's wish is ignored.
    off = tiny_llm(tiny_model_dirs["llama"])
    assert off.engine.add_request("f", [1, 2], _greedy(4)[0],
                                  num_speculative_tokens=3).num_speculative_tokens == 0


@pytest.mark.parametrize("padded", [False, True])
def test_mixed_batch_of_speculating_and_plain_requests(tiny_model_dirs: dict[str, Path],
                                                       plain: dict[str, list[int]],
                                                       padded: bool) -> None:
    llm = _spec_llm(tiny_model_dirs["llama"], padded)
    llm.engine.proposer = _ScriptedProposer(
        PROMPTS, [plain[f"r{i}"] for i in range(len(PROMPTS))], wrong_from=1)
    params = [*_greedy(24, 17), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                               logprobs=2), *_greedy(9, 21)]
    got, _ = _run(llm, params)
    assert _tokens(got) == plain
    assert len([lp for o in got["r2"] for lp in o.new_logprobs]) == 30
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert (llm.engine.runner.num_uniform_verify_steps > 0) == padded


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="method"):
        SpeculativeConfig(method="eagle").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=99).validate()
    with pytest.raises(ConfigError, match="min_accepted_per_step"):
        SpeculativeConfig(method="ngram", min_accepted_per_step=-1).validate()
    with pytest.raises(ConfigError, match="min_accepted_per_step"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                          min_accepted_per_step=3).validate()
    with pytest.raises(ConfigError, match="prompt_lookup"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2).validate()
    with pytest.raises(EngineInputError, match="speculative_config"):
        LLM(speculative_config={"methd": "ngram"})


def test_smollm2_ngram_greedy_matches_plain_decoding(smollm2: LLM) -> None:
    """The real default model on a prompt that repeats itself: same text, fewer steps; and a
    stop string that ends inside a step's accepted drafts cuts the output where plain decoding
    stops (the drafts after it are not output). Plain decoding: the session's engine."""
    prompt = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
              "Now repeat it again: apple, banana,")
    params = SamplingParams(temperature=0, max_tokens=32)
    steps_before = smollm2.engine.num_steps
    plain_out = smollm2.generate([prompt], params)[0].outputs[0]
    plain_steps = smollm2.engine.num_steps - steps_before
    # A stop string from the middle of the output: the text of output tokens 6-7.
    tok = smollm2.get_tokenizer()
    stop = tok.decode(plain_out.token_ids[6:8])
    assert stop.strip() and stop in plain_out.text
    stop_params = SamplingParams(temperature=0, max_tokens=32, stop=[stop])
    plain_stop = smollm2.generate([prompt], stop_params)[0].outputs[0]

    spec_llm = LLM(device="cpu", cpu_threads=2, num_gpu_blocks=256, speculative_config=NGRAM)
    spec_out = spec_llm.generate([prompt], params)[0].outputs[0]
    spec_steps = spec_llm.engine.num_steps
    accepted = spec_llm.engine.scheduler.num_accepted_tokens
    spec_stop = spec_llm.generate([prompt], stop_params)[0].outputs[0]
    spec_llm.shutdown()
    assert spec_out.token_ids == plain_out.token_ids and spec_out.text == plain_out.text
    assert accepted > 0 and spec_steps < plain_steps
    assert plain_stop.finish_reason == "stop" and spec_stop.finish_reason == "stop"
    assert spec_stop.token_ids == plain_stop.token_ids and spec_stop.text == plain_stop.text


class _NeverProposer(SequenceProposer):
    def __init__(self) -> None:
        self.calls = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        self.calls += 1
        return []


def test_requests_without_drafts_keep_async_overlap(tiny_model_dirs: dict[str, Path],
                                                     plain: dict[str, list[int]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose proposals miss overlaps its steps again (async scheduling), with one
    synchronous step every SPEC_PROBE_INTERVAL for the proposer to look again."""
    from engine.spec import SPEC_PROBE_INTERVAL

    llm = _spec_llm(tiny_model_dirs["llama"], async_scheduling=True)
    proposer = _NeverProposer()
    llm.engine.proposer = proposer
    runner = llm.engine.runner
    real = runner.inputs.last_sampled_row
    gathers: list[str] = []

    def spy(request_id: str) -> int:
        gathers.append(request_id)
        return real(request_id)

    monkeypatch.setattr(runner.inputs, "last_sampled_row", spy)
    got, _ = _run(llm, _greedy(24, 17, 30, 9, 21))
    assert _tokens(got) == plain
    assert len(gathers) > 50  # inputs taken from the device: steps overlapped
    # The proposer looked once per probe interval, not at every token (149 tokens in all).
    total = sum(len(t) for t in plain.values())
    assert proposer.calls <= total // SPEC_PROBE_INTERVAL + 2 * len(PROMPTS)


def test_requests_whose_drafts_keep_failing_pause_drafting(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]]) -> None:
    """Wrong drafts every time: with the default floor a request pauses drafting after its
    verify steps accept nothing (and tries again after SPEC_PROBE_INTERVAL steps), so it
    verifies far fewer drafts than with the floor off; the tokens are the same either way."""
    drafted = {}
    for floor in (0.0, NGRAM_FLOOR):
        llm = tiny_llm(tiny_model_dirs["llama"],
                       speculative_config={**NGRAM, "min_accepted_per_step": floor})
        llm.engine.proposer = _ScriptedProposer(
            PROMPTS, [plain[f"r{i}"] for i in range(len(PROMPTS))], wrong_from=0)
        outs, _ = _run(llm, _greedy(24, 17, 30, 9, 21))
        assert _tokens(outs) == plain
        assert llm.engine.scheduler.num_accepted_tokens == 0
        drafted[floor] = llm.engine.scheduler.num_draft_tokens
    assert drafted[NGRAM_FLOOR] * 3 < drafted[0.0]


def test_a_good_verify_step_resumes_drafting(tiny_model_dirs: dict[str, Path],
                                             plain: dict[str, list[int]]) -> None:
    """Drafts right after the first two: 2 accepted per step, above the floor: never paused."""
    llm = _spec_llm(tiny_model_dirs["llama"])
    llm.engine.proposer = _ScriptedProposer(
        PROMPTS, [plain[f"r{i}"] for i in range(len(PROMPTS))], wrong_from=2)
    outs, steps = _run(llm, _greedy(24, 17, 30, 9, 21))
    assert _tokens(outs) == plain
    assert steps <= 30 // 3 + 3  # ~3 tokens per step all the way


@pytest.mark.parametrize("padded", [False, True])
def test_drafts_stop_at_the_context_end(tiny_model_dirs: dict[str, Path], padded: bool) -> None:
    """Right drafts up to max_model_len: the last steps draft only what still fits, and the
    output is plain decoding's to the last position. Padded: verify steps take the padded
    layout while its padding rows fit the context, the ragged one after."""
    prompts = [PROMPTS[1][:21], PROMPTS[3][:26]]
    params = [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)] * 2
    want, _ = _run(tiny_llm(tiny_model_dirs["llama"], max_model_len=32), params, prompts)
    llm = _spec_llm(tiny_model_dirs["llama"], padded, max_model_len=32)
    llm.engine.proposer = _ScriptedProposer(prompts, [_tokens(want)[f"r{i}"] for i in range(2)])
    got, _ = _run(llm, params, prompts)
    assert _tokens(got) == _tokens(want)
    assert [len(t) for t in _tokens(got).values()] == [32 - 21, 32 - 26]
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert (llm.engine.runner.num_uniform_verify_steps > 0) == padded


class _EveryThird(_ScriptedProposer):
    """Per sequence: two right drafts (then wrong ones) at every third proposal, all wrong at
    the others: 0.67 accepted per verify step, above the default floor of 0.4, with two verify
    steps in a row that accept nothing."""

    def __init__(self, prompts: Sequence[list[int]], outputs: Sequence[list[int]]) -> None:
        super().__init__(prompts, outputs, wrong_from=2)
        self.calls = [0] * len(self.full)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for i, seq in enumerate(self.full):
            if seq[:len(token_ids)] == token_ids:
                self.calls[i] += 1
                if self.calls[i] % 3 == 1:
                    return super().propose(token_ids, k)
                return [(t + 1) % 200 for t in seq[len(token_ids):len(token_ids) + k]]
        return []


def test_a_request_above_the_floor_is_not_paused_by_a_run_of_failures(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]]) -> None:
    """Accepting 0.67 drafts per verify step on average (2, 0, 0, ...), a request drafts at
    every step, as with the floor off (an average that forgot all but two steps paused it)."""
    drafted = {}
    for floor in (0.0, NGRAM_FLOOR):
        llm = tiny_llm(tiny_model_dirs["llama"],
                       speculative_config={**NGRAM, "min_accepted_per_step": floor})
        llm.engine.proposer = _EveryThird(PROMPTS, [plain[f"r{i}"] for i in range(len(PROMPTS))])
        outs, _ = _run(llm, _greedy(24, 17, 30, 9, 21))
        assert _tokens(outs) == plain
        drafted[floor] = llm.engine.scheduler.num_draft_tokens
    assert drafted[NGRAM_FLOOR] == drafted[0.0] > 0


def test_pauses_of_a_request_whose_drafts_keep_failing_grow() -> None:
    """Always wrong: pauses of 8, 16, 32, 64, 64 tokens, each after four verify steps (the
    long average falls below the floor again in four from its restart; the short one in two)."""
    from engine.spec import MAX_PAUSE_TOKENS, SPEC_PROBE_INTERVAL, propose_all, record_verify

    class _Wrong(SequenceProposer):
        def propose(self, token_ids: list[int], k: int) -> list[int]:
            return [0] * k

    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=10_000))
    req.num_speculative_tokens = 4
    pauses: list[int] = []
    verifies = 0
    for _ in range(400):
        propose_all([req], _Wrong(), NGRAM_FLOOR)
        if req.spec_token_ids:
            verifies += 1
            record_verify(req, len(req.spec_token_ids), 0)
        elif req.spec_resume_at - req.num_tokens == req.spec_pause_tokens:  # a pause began
            pauses.append(req.spec_pause_tokens)
        req.append_output_token(7)
    assert pauses[:5] == [SPEC_PROBE_INTERVAL, 16, 32, MAX_PAUSE_TOKENS, MAX_PAUSE_TOKENS]
    assert verifies <= 4 * len(pauses) + 1
