"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's log-probability given
the tokens before it, checked against `transformers` on the same weights — across prefill
chunks, with the prefix cache holding the prompt, after a preemption, under async scheduling,
and for a batch mixing requests that ask for them with requests that do not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine import SamplingParams
from engine.logprobs import TokenLogprob
from engine.outputs import RequestOutput
from engine_api.errors import EngineInputError
from engine_api.request_options import RemoteKv, RequestOptions
from engine_api.sampling_params import SamplingParamsError
from tests.support.engine_driver import tiny_llm

PROMPT = [(11 * j + 5) % 380 + 2 for j in range(37)]
OTHER = [(13 * j + 1) % 380 + 2 for j in range(21)]
K = 3


def _reference(hf: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """[P, V] log-softmax of the reference model's logits at every prompt position."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)


def _check(out: RequestOutput, ref: torch.Tensor, prompt: list[int], k: int = K,
           tol: float = 1e-4) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt)
    assert lps[0] is None
    for i, lp in enumerate(lps[1:], start=1):
        assert isinstance(lp, TokenLogprob)
        assert lp.token_id == prompt[i]
        row = ref[i - 1]
        want = row[prompt[i]].item()
        assert lp.logprob == pytest.approx(want, abs=tol)
        # Rank and top-k as the reference orders them, up to ties within the tolerance.
        # (The upper bound counts the token itself among those above `want - tol`.)
        assert int((row > want + tol).sum()) + 1 <= (lp.rank or 0) <= int((row > want - tol).sum())
        assert [v for _, v in lp.top] == pytest.approx(row.topk(k).values.tolist(), abs=tol)
        assert [v for _, v in lp.top] == pytest.approx([row[t].item() for t, _ in lp.top], abs=tol)


def _ids(*prompts: list[int]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def _params(prompt_logprobs: int | None = K, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          prompt_logprobs=prompt_logprobs)


@pytest.fixture(scope="module")
def ref_llama(hf_reference: Callable[[str], PreTrainedModel]) -> Callable[[list[int]], torch.Tensor]:
    model = hf_reference("llama")
    return lambda prompt: _reference(model, prompt)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_hf_over_chunks(tiny_model_dirs: dict[str, Path],
                                              ref_llama: Callable[[list[int]], torch.Tensor],
                                              async_scheduling: bool) -> None:
    # 8-token chunks: the 37-token prompt is scored over five steps, the last one sampling.
    llm = tiny_llm(tiny_model_dirs["llama"], max_num_batched_tokens=8,
                   async_scheduling=async_scheduling)
    plain = llm.generate(_ids(PROMPT), _params(None))[0]
    out = llm.generate(_ids(PROMPT, OTHER), [_params(), _params(None)])
    _check(out[0], ref_llama(PROMPT), PROMPT)
    assert out[1].prompt_logprobs is None
    # Scoring the prompt changes nothing about the completion.
    assert out[0].outputs[0].token_ids == plain.outputs[0].token_ids
    llm.engine.scheduler.check_integrity()
    assert not llm.engine.kv.req_to_blocks


def test_prompt_logprobs_ignore_the_prefix_cache(tiny_model_dirs: dict[str, Path],
                                                 ref_llama: Callable[[list[int]], torch.Tensor]
                                                 ) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"])
    warm = llm.generate(_ids(PROMPT), _params(None))[0]
    assert warm.num_cached_tokens == 0
    # The prompt's blocks are cached now; a scored request computes them again all the same.
    out = llm.generate(_ids(PROMPT), _params())[0]
    assert out.num_cached_tokens == 0
    _check(out, ref_llama(PROMPT), PROMPT)
    # ... and leaves the cache as useful as before to requests that do not score.
    again = llm.generate(_ids(PROMPT), _params(None))[0]
    assert again.num_cached_tokens >= len(PROMPT) - 4
    assert again.outputs[0].token_ids == warm.outputs[0].token_ids


def test_prompt_logprobs_survive_a_preemption(tiny_model_dirs: dict[str, Path],
                                              ref_llama: Callable[[list[int]], torch.Tensor]
                                              ) -> None:
    # 14 blocks of 4 tokens: two 37-token prompts cannot both be held, so the newer is
    # preempted mid-prefill (after some of its prompt was scored) and recomputed.
    llm = tiny_llm(tiny_model_dirs["llama"], num_gpu_blocks=14, max_num_batched_tokens=16,
                   enable_prefix_caching=False)
    second = [*PROMPT[1:], 7]
    out = llm.generate(_ids(PROMPT, second), [_params(max_tokens=12), _params(max_tokens=12)])
    assert llm.engine.scheduler.num_preemptions > 0
    _check(out[0], ref_llama(PROMPT), PROMPT)
    _check(out[1], ref_llama(second), second)


def test_one_token_prompt_and_top_zero_and_one(tiny_model_dirs: dict[str, Path],
                                       ref_llama: Callable[[list[int]], torch.Tensor]) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"])
    single, zero, one = llm.generate(_ids([42], PROMPT, PROMPT), [_params(), _params(0),
                                                                  _params(1)])
    assert single.prompt_logprobs == [None]
    _check(zero, ref_llama(PROMPT), PROMPT, k=0)
    _check(one, ref_llama(PROMPT), PROMPT, k=1)  # a max, not a top-k
    assert all(lp is None or lp.top == [] for lp in zero.prompt_logprobs or [])


def test_n_completions_score_the_prompt_once(tiny_model_dirs: dict[str, Path],
                                             ref_llama: Callable[[list[int]], torch.Tensor]
                                             ) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"])
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=K)
    out = llm.generate(_ids(PROMPT), params)[0]
    assert len(out.outputs) == 3
    _check(out, ref_llama(PROMPT), PROMPT)


def test_prompt_logprobs_validation(tiny_model_dirs: dict[str, Path]) -> None:
    for bad in (-1, 21, 1.5, "2"):
        with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    llm = tiny_llm(tiny_model_dirs["llama"])
    # KV computed elsewhere cannot be scored here: refused, not answered without the logprobs.
    with pytest.raises(EngineInputError, match="prompt_logprobs"):
        llm.engine.check_request(PROMPT, RequestOptions(_params(),
                                                        remote_kv=RemoteKv(num_tokens=len(PROMPT))))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_prompt_logprobs_on_the_gpu(tiny_model_dirs: dict[str, Path],
                                    ref_llama: Callable[[list[int]], torch.Tensor]) -> None:
    """Scored chunks in mixed steps beside decodes replayed from CUDA graphs, under async
    scheduling; against `transformers` on the CPU."""
    llm = tiny_llm(tiny_model_dirs["llama"], device="cuda", max_num_batched_tokens=8,
                   num_gpu_blocks=256)
    assert llm.engine.async_scheduling and llm.engine.runner.graphs is not None
    # Four short prompts first: they decode while the scored prompt is prefilled in chunks.
    short = [[3 + i, 9, 27, 81 + i] for i in range(4)]
    out = llm.generate(_ids(*short, PROMPT, OTHER),
                       [*[_params(None, max_tokens=24)] * 4, _params(), _params(2)])
    _check(out[4], ref_llama(PROMPT), PROMPT, tol=1e-3)
    _check(out[5], ref_llama(OTHER), OTHER, k=2, tol=1e-3)
    llm.engine.scheduler.check_integrity()


def test_scoring_is_unbiased_against_float64() -> None:
    """Scored logprobs are `logit - logsumexp` in float32: within 3e-6 of float64 and unbiased
    (torch's float32 `log_softmax` on the CPU runs ~8e-6 high: a bias that sums over a long
    text; bench/results/cpu_logsoftmax_bias.json)."""
    from engine.kernels.reference import score_rows_ref

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(256, 49152, generator=gen) * 4 + 5
    targets = torch.randint(0, 49152, (256,), generator=gen)
    exact = logits.double().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    err = score_rows_ref(logits, targets)[0].double() - exact
    assert err.abs().max().item() < 3e-6
    assert abs(err.mean().item()) < 3e-7
