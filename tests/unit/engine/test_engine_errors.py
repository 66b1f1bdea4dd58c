"""Bad input fails early (at SamplingParams / add_request / LLM() time) with a specific error that
names the field or file and what is allowed; the engine stays usable afterwards."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from engine.llm import LLM
from engine.loader import ModelLoadError
from engine_api.errors import EngineInputError
from engine_api.sampling_params import SamplingParams, SamplingParamsError
from tests.support.engine_driver import greedy, tiny_llm


@pytest.fixture(scope="module")
def llm(tiny_model_dirs: dict[str, Path]) -> LLM:
    return tiny_llm(tiny_model_dirs["llama"], max_model_len=32)


@pytest.mark.parametrize("field,kwargs,allowed", [
    ("max_tokens", {"max_tokens": 0}, ">= 1"),
    ("max_tokens", {"max_tokens": -3}, ">= 1"),
    ("top_p", {"top_p": 0.0}, "(0, 1]"),
    ("top_p", {"top_p": 1.5}, "(0, 1]"),
    ("temperature", {"temperature": -0.1}, "[0, 100]"),
    ("temperature", {"temperature": float("nan")}, "[0, 100]"),
    ("temperature", {"temperature": 1e308}, "[0, 100]"),
    ("top_k", {"top_k": -2}, ">= 1"),
    ("min_p", {"min_p": 1.5}, "[0, 1]"),
    ("presence_penalty", {"presence_penalty": 3.0}, "[-2, 2]"),
    ("repetition_penalty", {"repetition_penalty": 0.0}, "> 0"),
    ("logprobs", {"logprobs": 21}, "[0, 20]"),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 2}, "<= max_tokens"),
])
def test_bad_sampling_params(field: str, kwargs: dict[str, Any], allowed: str) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert field in str(e.value) and allowed in str(e.value)


def test_params_mutated_after_construction_rejected_at_add_request(llm: LLM) -> None:
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(SamplingParamsError, match="top_p"):
        llm.engine.add_request("mut", [1, 2, 3], params)
    assert "mut" not in llm.engine.scheduler.requests


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(EngineInputError, match="prompt must not be empty"):
        llm.engine.add_request("e", [], greedy(2))
    with pytest.raises(EngineInputError, match="prompt"):
        llm.generate({"prompt_token_ids": []}, greedy(2))


def test_prompt_longer_than_max_model_len(llm: LLM) -> None:
    with pytest.raises(EngineInputError, match="max_model_len is 32"):
        llm.engine.add_request("long", list(range(40)), greedy(2))
    with pytest.raises(EngineInputError, match="max_model_len"):
        llm.engine.add_request("full", list(range(32)), greedy(2))  # no room for one token
    assert not llm.engine.scheduler.requests




@pytest.mark.parametrize("bad", [
    [1, 384], [1, -1], [True, 2],
], ids=["vocab", "negative", "bool"])
def test_token_ids_out_of_vocab(llm: LLM, bad: list[int]) -> None:
    try:
        with pytest.raises(EngineInputError, match=r"prompt_token_ids .*\[0, 384\)"):
            llm.engine.add_request("oov", bad, greedy(2))
        assert not llm.engine.scheduler.requests
    finally:
        llm.engine.abort_request("oov")  # keep the shared engine clean if it was accepted


def test_duplicate_request_id(llm: LLM) -> None:
    llm.engine.add_request("dup", [1, 2], greedy(1))
    try:
        with pytest.raises(ValueError, match="duplicate request id 'dup'"):
            llm.engine.add_request("dup", [3, 4], greedy(1))
    finally:
        llm.engine.abort_request("dup")


def test_engine_still_serves_after_errors(llm: LLM) -> None:
    [out] = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(3))
    assert len(out.outputs[0].token_ids) == 3
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_unknown_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        LLM(model=str(missing), device="cpu")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        LLM(model=str(tmp_path), device="cpu")


@pytest.mark.parametrize("damage", ["truncate", "garbage-header"])
def test_corrupt_safetensors_fails_at_load(tiny_model_dirs: dict[str, Path], tmp_path: Path,
                                           damage: str) -> None:
    model_dir = tmp_path / "broken"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) - 1000])
    else:
        weights.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors") as e:
        LLM(model=str(model_dir), dtype="float32", device="cpu")
    assert "corrupt or truncated" in str(e.value)


def test_max_model_len_capped_to_kv_capacity(tiny_model_dirs: dict[str, Path]) -> None:
    """A sequence larger than the whole KV cache could never be scheduled: the engine lowers
    max_model_len to the cache's capacity and refuses longer prompts up front."""
    small = tiny_llm(tiny_model_dirs["llama"], num_gpu_blocks=3, max_model_len=64)
    assert small.engine.max_model_len == 3 * small.engine.config.cache.block_size
    with pytest.raises(EngineInputError, match="max_model_len"):
        small.generate({"prompt_token_ids": list(range(1, 13))}, greedy(2))
    out = small.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0,
                                                                          max_tokens=100))
    assert out[0].outputs[0].finish_reason == "length"
    assert len(out[0].outputs[0].token_ids) == small.engine.max_model_len - 3


def test_bad_prompt_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(EngineInputError):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], greedy(2))
    assert not llm.engine.scheduler.requests
    assert llm.generate({"prompt_token_ids": [1, 2]}, greedy(2))[0].outputs[0].token_ids
