"""The model's recommended sampling defaults (its generation_config.json), as vLLM applies them
(`--generation-config auto`): read as vLLM reads them (only values that differ from Hugging
Face's own defaults), used by `LLM` when no sampling params are given, and by the gateway for
each field a request leaves unset — what the workers receive is checked on the wire (fake
workers recording their requests; the real engine for `LLM`)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine_api.errors import EngineInputError
from engine_api.generation_defaults import (
    GenerationConfigError,
    resolve_sampling_defaults,
    sampling_defaults,
)
from gateway.config import GatewayConfigError
from tests.support.engine_driver import greedy, tiny_llm
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer


def test_read_as_vllm_reads_it() -> None:
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
             "eos_token_id": [151645, 151643], "bos_token_id": 151643}
    assert sampling_defaults(qwen3) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    # Hugging Face's own defaults are no recommendation (vLLM reads `to_diff_dict()`).
    assert sampling_defaults({"temperature": 1.0, "top_k": 50, "top_p": 1.0,
                              "repetition_penalty": 1.0}) == {}
    assert sampling_defaults({"max_new_tokens": 64, "top_k": 0, "min_p": 0.05,
                              "repetition_penalty": 1.1}) == {
        "max_tokens": 64, "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1}
    # An override wins, default-valued or not.
    assert sampling_defaults(qwen3, {"temperature": 1.0, "top_k": 50}) == {
        "temperature": 1.0, "top_k": 50, "top_p": 0.95}
    for bad, message in (({"temperature": -1}, "temperature must be at least 0"),
                         ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
                         ({"top_k": 2.5}, "top_k must be an integer"),
                         ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
                         ({"temperature": "hot"}, "a finite number")):
        with pytest.raises(GenerationConfigError, match=message):
            sampling_defaults(bad)
    with pytest.raises(GenerationConfigError, match="'seed' is not one of"):
        sampling_defaults({}, {"seed": 1})


def test_modes(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert resolve_sampling_defaults("auto", str(tmp_path)) == {"temperature": 0.7}
    assert resolve_sampling_defaults("auto", None) == {}  # a GGUF file: no directory
    assert resolve_sampling_defaults("vllm", str(tmp_path), {"top_p": 0.5}) == {"top_p": 0.5}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.8}))
    assert resolve_sampling_defaults(str(other), str(tmp_path)) == {"top_p": 0.8}
    with pytest.raises(GenerationConfigError, match="neither 'auto', 'vllm' nor a directory"):
        resolve_sampling_defaults(str(tmp_path / "missing"), None)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(GenerationConfigError, match=r"generation_config\.json"):
        resolve_sampling_defaults("auto", str(tmp_path))


def test_llm_uses_the_models_defaults(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A copy of the tiny Llama whose generation config recommends greedy decoding and 5 new
    tokens: `generate` without sampling params follows it; "vllm" does not."""
    import shutil

    model = tmp_path / "llama"
    shutil.copytree(tiny_model_dirs["llama"], model)
    gen = json.loads((model / "generation_config.json").read_text()) \
        if (model / "generation_config.json").exists() else {}
    (model / "generation_config.json").write_text(json.dumps(
        gen | {"temperature": 0.0, "max_new_tokens": 5}))
    prompt = [{"prompt_token_ids": [5, 17, 99, 3, 250]}]
    llm = tiny_llm(model)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    out = llm.generate(prompt)[0].outputs[0].token_ids
    assert out == llm.generate(prompt, greedy(5))[0].outputs[0].token_ids
    llm.shutdown()
    neutral = tiny_llm(model, generation_config="vllm", override_generation_config={"top_k": 3})
    params = neutral.get_default_sampling_params()
    assert (params.temperature, params.max_tokens, params.top_k) == (1.0, 16, 3)
    assert len(neutral.generate(prompt)[0].outputs[0].token_ids) == 16
    neutral.shutdown()
    with pytest.raises(EngineInputError, match="'nope' is not one of"):
        tiny_llm(model, override_generation_config={"nope": 1})


DEFAULTS = (("max_tokens", 9), ("min_p", 0.05), ("repetition_penalty", 1.2),
            ("temperature", 0.25), ("top_k", 7), ("top_p", 0.5))


def test_the_gateway_fills_unset_fields() -> None:
    ids = smollm2_tokenizer().encode("Hello there, friend", add_special_tokens=False)
    with Harness(Script(list(ids)), sampling_defaults=DEFAULTS) as h:
        def post(path: str, body: dict) -> None:
            r = httpx.post(h.base_url + path, json={"model": MODEL_NAME, **body}, timeout=30)
            assert r.status_code == 200, r.text

        post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        s = h.prefill[0].prefill_requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == pytest.approx(
            (0.25, 0.5, 7, 9))
        assert (s.min_p, s.repetition_penalty) == pytest.approx((0.05, 1.2))
        # What a request sets is its own; completions keep OpenAI's default of 16 tokens.
        post("/v1/completions", {"prompt": "hi", "temperature": 0.9, "top_k": -1})
        s = h.prefill[0].prefill_requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == pytest.approx(
            (0.9, 0.5, -1, 16))
        post("/v1/completions", {"prompt": "hi", "max_tokens": None})
        assert h.prefill[0].prefill_requests[-1].sampling.max_tokens == 9


def test_gateway_flags(tmp_path: Path) -> None:
    from gateway.server import build_parser, config_from_args

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    parse = build_parser().parse_args
    base = ["--decode", "127.0.0.1:1", "--colocated", "--model", str(tmp_path)]
    assert config_from_args(parse(base)).defaults == {"temperature": 0.3}
    assert config_from_args(parse([*base, "--generation-config", "vllm"])).defaults == {}
    config = config_from_args(parse([*base, "--override-generation-config", '{"top_p": 0.9}']))
    assert config.defaults == {"temperature": 0.3, "top_p": 0.9}
    with pytest.raises(GatewayConfigError, match="--override-generation-config"):
        config_from_args(parse([*base, "--override-generation-config", "{oops"]))
    # `splitserve up` hands the model's directory over when the gateway loads another
    # tokenizer, so "auto" still reads the model's file.
    from splitserve.up import build_parser as up_parser
    from splitserve.up import service_argv

    args, engine_args = up_parser().parse_known_args(
        ["--model", str(tmp_path), "--tokenizer", str(tmp_path / "tok.json")])
    gw = service_argv(args, engine_args)["gateway"]
    assert gw[gw.index("--generation-config") + 1] == str(tmp_path.resolve())


def test_the_grpc_api_fills_unset_fields() -> None:
    """temperature, top_k and min_p have presence on the wire: unset takes the model's value,
    an explicit 0 stays greedy / off; the zero-means-unset fields take it as before."""
    import grpc

    from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    ids = smollm2_tokenizer().encode("Hello there, friend", add_special_tokens=False)

    def sent(h: Harness, sampling: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        with grpc.insecure_channel(h.grpc_target) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            replies = list(stub.Generate(gateway_pb2.GenerateRequest(
                text="hi", model=MODEL_NAME, sampling=sampling), timeout=20))
        assert replies[-1].WhichOneof("response") == "complete", replies[-1]
        return h.prefill[0].prefill_requests[-1].sampling

    with Harness(Script(list(ids)), sampling_defaults=DEFAULTS) as h:
        s = sent(h, common_pb2.SamplingParams())
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == pytest.approx((0.25, 0.5, 7, 9))
        assert (s.min_p, s.repetition_penalty) == pytest.approx((0.05, 1.2))
        s = sent(h, common_pb2.SamplingParams(temperature=0.0, top_k=0, min_p=0.0, max_tokens=3))
        assert (s.temperature, s.top_k, s.min_p, s.max_tokens) == pytest.approx((0.0, -1, 0.0, 3))
    with Harness(Script(list(ids))) as h:   # no model defaults: greedy, as this API always was
        s = sent(h, common_pb2.SamplingParams(max_tokens=4))
        assert (s.temperature, s.top_k, s.min_p) == pytest.approx((0.0, -1, 0.0))
