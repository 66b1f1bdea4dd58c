"""Progress bars as vLLM shows them: the weights as they load, and `LLM.generate(use_tqdm=True)`
counting finished completions (nothing without it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.llm import LLM
from engine_api.sampling_params import SamplingParams


def test_loading_and_generating_show_progress(tiny_model_dirs: dict[str, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM(model=str(tiny_model_dirs["llama"]), device="cpu", max_model_len=64,
              num_gpu_blocks=16)
    assert "Loading weights" in capsys.readouterr().err
    params = SamplingParams(max_tokens=2, n=2, temperature=1.0, seed=1)
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
    llm.generate(prompts, params)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate(prompts, params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "4/4" in err
