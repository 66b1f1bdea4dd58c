"""`RequestOptions` validates what needs no engine once, where it is built (torch-free)."""

from __future__ import annotations

import dataclasses

import pytest

from engine_api.errors import EngineInputError
from engine_api.pooling_params import PoolingParams
from engine_api.request_options import RemoteKv, RequestOptions
from engine_api.sampling_params import SamplingParams


def test_a_bad_cache_salt_is_refused_when_built() -> None:
    assert RequestOptions(SamplingParams(), cache_salt="tenant-a").cache_salt == "tenant-a"
    for bad in ("", "x" * 10_000):
        with pytest.raises(EngineInputError, match="cache_salt"):
            RequestOptions(SamplingParams(), cache_salt=bad)


def test_an_embedding_request_takes_no_output_tokens_and_no_remote_kv() -> None:
    RequestOptions(PoolingParams())
    with pytest.raises(EngineInputError, match="embedding"):
        RequestOptions(PoolingParams(), output_token_ids=[1])
    with pytest.raises(EngineInputError, match="embedding"):
        RequestOptions(PoolingParams(), remote_kv=RemoteKv(num_tokens=4))


def test_prompt_logprobs_cannot_come_with_remote_kv_even_when_it_joins_later() -> None:
    options = RequestOptions(SamplingParams(prompt_logprobs=1))
    with pytest.raises(EngineInputError, match="prompt_logprobs"):
        dataclasses.replace(options, remote_kv=RemoteKv(num_tokens=4))
    plain = dataclasses.replace(RequestOptions(SamplingParams()), remote_kv=RemoteKv(4))
    assert plain.remote_kv == RemoteKv(4)


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RequestOptions(SamplingParams()).priority = 1  # type: ignore[misc]
