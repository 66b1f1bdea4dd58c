"""`truncate_prompt_tokens` (vLLM's): a prompt keeps its last k tokens where it is tokenized
(the offline `LLM` here). The real tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.llm import LLM
from engine_api.pooling_params import PoolingParams, PoolingParamsError
from engine_api.sampling_params import SamplingParams, SamplingParamsError, truncate_prompt
from tests.support.engine_driver import greedy

PROMPT = [5, 17, 99, 3, 250, 7, 42, 8, 300, 11, 4, 61]


def test_truncate_prompt_keeps_the_end() -> None:
    assert truncate_prompt(PROMPT, None, 64) == PROMPT
    assert truncate_prompt(PROMPT, 3, 64) == [11, 4, 61]
    assert truncate_prompt(PROMPT, 50, 64) == PROMPT
    assert truncate_prompt(PROMPT, -1, 5) == PROMPT[-5:]


@pytest.mark.parametrize("k", [0, -2, 1.5, True, "3"])
def test_bad_values_are_refused(k: object) -> None:
    with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=k)  # type: ignore[arg-type]
    with pytest.raises(PoolingParamsError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=k)  # type: ignore[arg-type]


def test_generate_and_embed_see_only_the_kept_tokens(tiny_model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            truncate_prompt_tokens=5)
    [cut] = llm.generate({"prompt_token_ids": PROMPT}, params)
    [tail] = llm.generate({"prompt_token_ids": PROMPT[-5:]}, greedy(6))
    [whole] = llm.generate({"prompt_token_ids": PROMPT}, greedy(6))
    assert cut.prompt_token_ids == PROMPT[-5:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    assert whole.outputs[0].token_ids != tail.outputs[0].token_ids  # the cut mattered
    [e_cut] = llm.embed({"prompt_token_ids": PROMPT}, PoolingParams(truncate_prompt_tokens=4,
                                                                    pooling_type="MEAN"))
    [e_tail] = llm.embed({"prompt_token_ids": PROMPT[-4:]}, PoolingParams(pooling_type="MEAN"))
    assert e_cut.prompt_token_ids == PROMPT[-4:]
    assert e_cut.outputs.embedding == pytest.approx(e_tail.outputs.embedding, abs=1e-6)
    llm.shutdown()
