"""Beam search (engine_api/beam_search.py, `LLM.beam_search`): the engine's search against a beam
search written here over `transformers`' full-recompute log-softmax on the same weights (the
same rule: top 2 * beam_width candidates per beam, vLLM's length-penalized score), width 1
against greedy decoding, EOS completing a beam, and parameter validation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine_api.beam_search import BeamSearch, BeamSearchParams, BeamSearchParamsError
from engine_api.errors import EngineInputError
from tests.support.engine_driver import greedy, tiny_llm

PROMPTS = [[(11 * j + 5) % 380 + 2 for j in range(9)], [7, 300, 12, 99, 5]]


def _reference(model: PreTrainedModel, prompt: list[int], width: int, steps: int,
               length_penalty: float) -> list[tuple[list[int], float]]:
    """Beam search by brute force: each beam's next-token log-softmax from a full forward."""
    beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]

    def score(b: tuple[list[int], float]) -> float:
        return b[1] / len(b[0]) ** length_penalty

    for _ in range(steps):
        live = []
        for tokens, cum in beams:
            with torch.no_grad():
                lp = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = lp.topk(2 * width)
            live += [([*tokens, int(t)], cum + float(v)) for v, t in zip(top.values, top.indices,
                                                                          strict=True)]
        beams = sorted(live, key=score, reverse=True)[:width]
    return beams


@pytest.mark.parametrize("width,length_penalty", [(3, 1.0), (2, 0.0)])
def test_matches_a_brute_force_search(tiny_model_dirs: dict[str, Path],
                                      hf_reference: Callable[[str], PreTrainedModel],
                                      width: int, length_penalty: float) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"])
    params = BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=True,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = _reference(hf_reference("llama"), prompt, width, 5, length_penalty)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(
            [w[1] for w in want], abs=1e-4)
        for s in out.sequences:
            assert s.output_token_ids == s.tokens[len(prompt):] and len(s.output_token_ids) == 5
            assert s.finish_reason == "length"
            assert sum(s.logprobs) == pytest.approx(s.cum_logprob)
    assert not llm.engine.has_unfinished_requests()


def test_width_one_is_greedy(tiny_model_dirs: dict[str, Path]) -> None:
    llm = tiny_llm(tiny_model_dirs["qwen3"])
    [out] = llm.beam_search({"prompt_token_ids": PROMPTS[0]},
                            BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    [gen] = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(6))
    assert out.sequences[0].output_token_ids == gen.outputs[0].token_ids


def test_eos_completes_a_beam() -> None:
    """A beam that ends in EOS leaves the live set; ranked with the others at the end by the
    length-penalized score (its EOS not counted)."""
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3), eos_token_ids=[0])
    search.expand([[(0, -0.1), (5, -0.5), (6, -0.7), (7, -3.0)]])
    assert [b.output_token_ids for b in search.beams] == [[5], [6]]
    assert [c.output_token_ids for c in search.completed] == [[0]]
    search.expand([[(8, -0.2), (0, -2.0)], [(9, -0.1), (10, -4.0)]])
    search.expand([[(11, -0.1)], [(12, -0.1)]])
    assert search.done and all(b.finish_reason == "length" for b in search.beams)
    best = search.results()
    # [1, 2, 0]: -0.1 / 2 = -0.05 beats [1, 2, 5, 8, 11]: -0.8 / 5 = -0.16.
    assert [b.output_token_ids for b in best] == [[0], [5, 8, 11]]
    assert best[0].finish_reason == "stop" and best[0].cum_logprob == pytest.approx(-0.1)
    assert best[1].cum_logprob == pytest.approx(-0.8)


def test_a_settled_search_stops_early() -> None:
    """Two beams complete at once with logprob -0.1, and the live ones have fallen below what
    they could ever beat: the search stops at step 2 of 50, with the answer a full run gives."""
    def run(stop_early: bool) -> tuple[int, list[list[int]]]:
        search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=50,
                                                     length_penalty=0.0), eos_token_ids=[0])
        search.expand([[(0, -0.1), (5, -2.0), (6, -3.0)]])
        search.expand([[(0, -0.05), (7, -1.0)], [(0, -0.2), (8, -1.0)]])
        while not (search.done if stop_early else search.steps >= 50 or not search.beams):
            search.expand([[(9, -0.5)] for _ in search.beams])
        return search.steps, [b.output_token_ids for b in search.results()]

    early, full = run(True), run(False)
    assert early[0] == 2 and full[0] == 50
    assert early[1] == full[1] == [[0], [5, 0]]
    # One completed beam is not enough for a width of 2.
    search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=9, length_penalty=0.0),
                        eos_token_ids=[0])
    search.expand([[(0, -0.1), (5, -9.0), (6, -9.5)]])
    assert not search.done


def test_validation(tiny_model_dirs: dict[str, Path]) -> None:
    for bad in (dict(beam_width=0, max_tokens=1), dict(beam_width=11, max_tokens=1),
                dict(beam_width=2, max_tokens=0), dict(beam_width=2, max_tokens=1,
                                                       length_penalty=math.inf),
                dict(beam_width=2, max_tokens=1, temperature=-1.0)):
        with pytest.raises(BeamSearchParamsError):
            BeamSearchParams(**bad)  # type: ignore[arg-type]
    llm = tiny_llm(tiny_model_dirs["llama"], max_model_len=16)
    with pytest.raises(EngineInputError, match="no room"):
        llm.beam_search({"prompt_token_ids": list(range(2, 18))},
                        BeamSearchParams(beam_width=2, max_tokens=4))
    # max_tokens stops at the context: 12 prompt tokens leave 4.
    [out] = llm.beam_search({"prompt_token_ids": list(range(2, 14))},
                            BeamSearchParams(beam_width=2, max_tokens=9, ignore_eos=True))
    assert {len(s.output_token_ids) for s in out.sequences} == {4}
