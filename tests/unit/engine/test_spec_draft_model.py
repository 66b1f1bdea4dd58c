"""Speculative decoding with a draft model (engine/draft_model.py): a second engine drafts
greedily, the target verifies. Tiny random models on the CPU: the target as its own draft (every
draft right), another model as the draft (almost every draft wrong); greedy output must be plain
decoding's either way, token for token."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.cli_args import add_engine_args, engine_config_from_args
from engine.config import ConfigError, EngineConfig, LoadConfig, SchedulerConfig, SpeculativeConfig
from engine.draft_model import DraftModelProposer
from engine.llm_engine import LLMEngine
from engine_api.errors import EngineInputError
from tests.support.engine_driver import run_steps, step_tokens, tiny_llm

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],
    [(7 * j) % 250 + 1 for j in range(23)],
    [9, 9, 9, 9, 9, 9],
    [(3 * j * j + 1) % 200 + 1 for j in range(40)],
]
LENGTHS = (30, 17, 26, 21)


def _greedy() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENGTHS]


def _draft(path: Path, k: int = 4) -> dict[str, Any]:
    return {"model": str(path), "num_speculative_tokens": k, "step_budget": False}


@pytest.fixture(scope="module")
def plain(tiny_model_dirs: dict[str, Path]) -> tuple[dict[str, list[int]], int]:
    outs, steps = run_steps(tiny_llm(tiny_model_dirs["llama"]), PROMPTS, _greedy())
    return step_tokens(outs), steps


def _proposer(llm: LLM) -> DraftModelProposer:
    proposer = llm.engine.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def test_target_as_its_own_draft_accepts_every_draft(
        tiny_model_dirs: dict[str, Path], plain: tuple[dict[str, list[int]], int]) -> None:
    want, plain_steps = plain
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=_draft(tiny_model_dirs["llama"]))
    outs, steps = run_steps(llm, PROMPTS, _greedy())
    assert step_tokens(outs) == want
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 50
    assert sched.num_accepted_tokens == sched.num_draft_tokens
    # Five tokens per verify step once every prompt is in.
    assert steps * 3 < plain_steps
    proposer = _proposer(llm)
    # k steps per round and a catch-up step when all 4 drafts were accepted, all requests
    # batched in each; the first round computes the prompts in one more.
    assert proposer.num_steps <= 5 * proposer.num_rounds + 1


def test_the_draft_keeps_its_kv_between_rounds(tiny_model_dirs: dict[str, Path]) -> None:
    """After its first round a request's draft computes only the rows it has not seen: none
    beyond the last known token after a rejection, one when every draft was accepted (the last
    draft is sampled, never fed). Its blocks go back when the request finishes."""
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=_draft(tiny_model_dirs["llama"]))
    proposer = _proposer(llm)
    free = len(proposer.free_blocks)
    run_steps(llm, PROMPTS, _greedy())
    first = sum(len(p) - 1 for p in PROMPTS)
    assert proposer.num_rounds > 5
    assert first < proposer.num_catchup_tokens <= first + proposer.num_rounds * len(PROMPTS)
    assert not proposer.seqs and len(proposer.free_blocks) == free


def test_a_wrong_draft_model_changes_no_token(
        tiny_model_dirs: dict[str, Path], plain: tuple[dict[str, list[int]], int]) -> None:
    """Another model's greedy drafts: nearly all rejected, drafting pauses, the tokens are the
    target's."""
    want, _ = plain
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=_draft(tiny_model_dirs["llama3"]))
    outs, _ = run_steps(llm, PROMPTS, _greedy())
    assert step_tokens(outs) == want
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 0
    assert sched.num_accepted_tokens < sched.num_draft_tokens / 4


def test_seeded_sampling_with_a_draft_is_reproducible(tiny_model_dirs: dict[str, Path]) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=20,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    runs = []
    for _ in range(2):
        llm = tiny_llm(tiny_model_dirs["llama"],
                       speculative_config=_draft(tiny_model_dirs["llama"]))
        outs, _ = run_steps(llm, PROMPTS, params)
        runs.append(step_tokens(outs))
        # Random weights spread the target's distribution thin: few greedy drafts survive, but
        # each verify step draws from the request's generator.
        assert llm.engine.scheduler.num_draft_tokens > 0
    assert runs[0] == runs[1]
    assert all(len(t) == 20 for t in runs[0].values())


def test_sampled_drafts_carry_their_distribution(tiny_model_dirs: dict[str, Path]) -> None:
    """Random sampling, the target as its own draft: drafts sampled from the same distribution
    as the target's (q = p) are accepted with probability min(1, p/q) = 1, so nearly all are
    accepted (float rounding between the draft's decode steps and the verify step aside). A
    greedy draft would be accepted only p(argmax) of the time: rarely, with a random model's
    flat distributions (the reproducibility test above sees few accepted)."""
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
              for _ in PROMPTS]
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=_draft(tiny_model_dirs["llama"]))
    outs, steps = run_steps(llm, PROMPTS, params)
    assert all(len(t) == 20 for t in step_tokens(outs).values())
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 40
    assert sched.num_accepted_tokens >= 0.95 * sched.num_draft_tokens
    assert steps < 10


def test_drafts_stop_at_the_context_end(tiny_model_dirs: dict[str, Path]) -> None:
    """max_model_len 32: the last rounds draft only what still fits; plain decoding's tokens to
    the last position."""
    prompts = [PROMPTS[1][:21], PROMPTS[3][:26]]
    params = [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)] * 2
    want, _ = run_steps(tiny_llm(tiny_model_dirs["llama"], max_model_len=32), prompts, params)
    llm = tiny_llm(tiny_model_dirs["llama"], max_model_len=32,
                   speculative_config=_draft(tiny_model_dirs["llama"]))
    got, _ = run_steps(llm, prompts, params)
    assert step_tokens(got) == step_tokens(want)
    assert [len(t) for t in step_tokens(got).values()] == [32 - 21, 32 - 26]
    assert _proposer(llm).max_model_len == 32


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="vocabulary"):
        tiny_llm(tiny_model_dirs["llama"], speculative_config=_draft(Path("dummy:tiny")))


def test_the_method_needs_a_model() -> None:
    with pytest.raises(ConfigError, match="draft's `model`"):
        SpeculativeConfig(method="draft_model").validate()
    with pytest.raises(ConfigError, match="draft_gpu_memory_utilization"):
        SpeculativeConfig(method="draft_model", model="dummy:tiny",
                          draft_gpu_memory_utilization=1.5).validate()


def test_cli_flags_configure_the_draft() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "dummy:tiny", "--speculative-method", "draft_model",
                         "--speculative-model", "dummy:tiny", "--num-speculative-tokens", "3",
                         "--speculative-draft-gpu-memory-utilization", "0.2"])
    spec = engine_config_from_args(args).speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "dummy:tiny", 3)
    assert spec.draft_gpu_memory_utilization == 0.2


def test_prefill_role_loads_no_draft_and_shutdown_frees_it(tiny_model_dirs: dict[str, Path]) -> None:
    spec = SpeculativeConfig(method="draft_model", model=str(tiny_model_dirs["llama"]))
    base = dict(load=LoadConfig(model=str(tiny_model_dirs["llama"]), dtype="float32"),
                speculative=spec)
    prefill = LLMEngine(EngineConfig(scheduler=SchedulerConfig(role="prefill"), **base))
    assert prefill.proposer is None
    decode = LLMEngine(EngineConfig(scheduler=SchedulerConfig(role="decode"), **base))
    proposer = decode.proposer
    assert isinstance(proposer, DraftModelProposer)
    decode.shutdown()
    assert proposer.runner.kv_cache.numel() == 0 and not proposer.seqs


def test_a_full_draft_cache_and_preemption_change_no_token(
        tiny_model_dirs: dict[str, Path], plain: tuple[dict[str, list[int]], int]) -> None:
    """30 blocks of 4 tokens for the target and as many for the draft: the target preempts
    and recomputes, the draft finds no room for some requests (they get no drafts that round
    and start over later); the tokens are plain decoding's."""
    want, _ = plain
    llm = tiny_llm(tiny_model_dirs["llama"], num_gpu_blocks=30,
                   speculative_config=_draft(tiny_model_dirs["llama"]))
    outs, _ = run_steps(llm, PROMPTS, _greedy())
    assert step_tokens(outs) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.num_accepted_tokens > 0
    proposer = _proposer(llm)
    assert proposer.num_no_room > 0
    assert not proposer.seqs and len(proposer.free_blocks) == 30


def test_an_aborted_request_gives_its_draft_blocks_back(tiny_model_dirs: dict[str, Path]) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=_draft(tiny_model_dirs["llama"]))
    proposer = _proposer(llm)
    free = len(proposer.free_blocks)
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(PROMPTS, _greedy(), strict=True)):
        eng.add_request(f"r{i}", p, sp)
    for _ in range(3):
        eng.step()
    assert set(proposer.seqs) == {f"r{i}" for i in range(len(PROMPTS))}
    assert eng.abort_request("r1")
    assert "r1" not in proposer.seqs
    while eng.has_unfinished_requests():
        eng.step()
    assert not proposer.seqs and len(proposer.free_blocks) == free


def test_each_request_picks_its_proposer(tiny_model_dirs: dict[str, Path],
                                         plain: tuple[dict[str, list[int]], int]) -> None:
    """A draft-model engine also holds n-gram lookup: a request that asks for "ngram" never
    reaches the draft model, one that asks for "draft_model" (or nothing) drafts with it; the
    tokens are plain decoding's either way. An n-gram engine serves "draft_model" with n-gram."""
    want, _ = plain
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=_draft(tiny_model_dirs["llama"]))
    assert set(llm.engine.proposers) == {"draft_model", "ngram", "suffix"}
    proposer = _proposer(llm)
    outs, _ = run_steps(llm, PROMPTS, _greedy(), speculative_method="ngram")
    assert step_tokens(outs) == want
    assert proposer.num_rounds == 0
    assert llm.engine.scheduler.num_draft_tokens > 0  # the repeating prompts found n-grams
    outs, _ = run_steps(llm, PROMPTS, _greedy(), speculative_method="draft_model")
    assert step_tokens(outs) == want
    assert proposer.num_rounds > 5 and not proposer.seqs
    with pytest.raises(EngineInputError, match="speculative_method"):
        llm.engine.add_request("bad", PROMPTS[0], _greedy()[0], speculative_method="eagle")

    ngram = tiny_llm(tiny_model_dirs["llama"],
                     speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert set(ngram.engine.proposers) == {"ngram", "suffix"}
    req = ngram.engine.add_request("r", PROMPTS[0], _greedy()[0], speculative_method="draft_model")
    assert req.spec_method == "ngram"
    ngram.engine.abort_request("r")
