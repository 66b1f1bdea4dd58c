"""The command line in vLLM's shape: `serve MODEL`, its prefix-caching, dtype and KV-dtype
spellings, tracing and request-logging flags, `--host` as the REST bind, and the API key from
the environment (out of `ps`)."""

from __future__ import annotations

import pytest

from engine.cli_args import engine_config_from_args
from gateway.server import build_parser as gateway_parser
from gateway.server import config_from_args
from splitserve import up
from splitserve.serve import build_serve_parser, positional_model


def _serve(*argv: str):  # type: ignore[no-untyped-def]
    return build_serve_parser().parse_args(positional_model(list(argv)))


def test_serve_takes_the_model_first_and_runs_colocated_by_default() -> None:
    args = _serve("/models/llama", "--no-enable-prefix-caching", "--dtype", "half",
                  "--kv-cache-dtype", "fp8_e4m3", "--host", "0.0.0.0")
    assert (args.model, args.role, args.host) == ("/models/llama", "colocated", "0.0.0.0")
    config = engine_config_from_args(args)
    assert config.cache.enable_prefix_caching is False
    assert config.load.dtype == "float16"
    assert config.cache.kv_cache_dtype == "fp8"
    assert engine_config_from_args(_serve("--enable-prefix-caching")).cache.enable_prefix_caching
    assert not engine_config_from_args(_serve("--no-prefix-caching")).cache.enable_prefix_caching
    assert _serve("--role", "decode", "--model", "m").role == "decode"


def test_unsupported_spellings_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve("--kv-cache-dtype", "fp8_e5m2")
    assert "fp8_e5m2 is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _serve("--dtype", "double")
    assert "half" in capsys.readouterr().err


def test_gateway_flags_for_tracing_logging_and_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_API_KEY", "key-from-the-environment")
    argv = ["--decode", "127.0.0.1:1", "--colocated", "--otlp-traces-endpoint",
            "http://127.0.0.1:4317", "--enable-log-requests", "--uvicorn-log-level", "info"]
    args = gateway_parser().parse_args(argv)
    assert args.host == "127.0.0.1"  # loopback unless told
    assert args.otlp_traces_endpoint == "http://127.0.0.1:4317"
    config = config_from_args(args)
    assert config.api_key == "key-from-the-environment"
    assert config.log_requests and config.uvicorn_log_level == "info"
    assert not config_from_args(gateway_parser().parse_args(
        [*argv[:3], "--disable-log-requests"])).log_requests
    worker = _serve("--otlp-traces-endpoint", "http://collector:4317")
    assert worker.otlp_traces_endpoint == "http://collector:4317"


def test_up_hands_the_api_key_in_the_environment_not_the_command_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_API_KEY", "secret-key-0123456789")
    args, engine_args = up.build_parser().parse_known_args(
        ["--otlp-traces-endpoint", "http://127.0.0.1:4317", "--enable-log-requests"])
    assert args.api_key == "secret-key-0123456789"
    argv = up.service_argv(args, engine_args)
    assert not any("secret-key" in a for service in argv.values() for a in service)
    gw = argv["gateway"]
    assert gw[gw.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4317"
    assert "--enable-log-requests" in gw
    assert "--otlp-traces-endpoint" in argv["prefill"]
