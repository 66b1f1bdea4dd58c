"""Engine flags reach the engine's config, and bad values are refused with the flag named."""

from __future__ import annotations

import argparse

import pytest

from engine import LLM
from engine.cli_args import add_engine_args, engine_config_from_args
from engine.config import DEFAULT_GC_THRESHOLD, ConfigError
from engine.cuda_graphs import bucket_sizes


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(["--model", "dummy:tiny", *argv])


def test_cuda_graph_max_batch_flag_reaches_the_runner_config() -> None:
    assert engine_config_from_args(_parse()).runner.cuda_graph_max_batch == 512
    cfg = engine_config_from_args(_parse("--cuda-graph-max-batch", "768"))
    assert cfg.runner.cuda_graph_max_batch == 768
    assert bucket_sizes(768)[-1] == 768 and bucket_sizes(768)[:4] == [1, 2, 4, 8]


BAD_FLAG_VALUES = [
    *(("--cuda-graph-max-batch", bad) for bad in ("0", "-8", "many")),
    *(("--piecewise-graph-max-tokens", bad) for bad in ("8", "4096", "-16", "lots")),
    *(("--gc-threshold", bad) for bad in ("700,10", "700,10,-1", "a,b,c", "1,2,3,4")),
]


@pytest.mark.parametrize("flag,bad", BAD_FLAG_VALUES)
def test_flag_rejects_bad_values(flag: str, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(flag, bad)
    assert flag in capsys.readouterr().err


def test_llm_refuses_a_zero_graph_batch() -> None:
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        LLM(model="dummy:tiny", dtype="float32", max_model_len=256, cuda_graph_max_batch=0)


def test_piecewise_graph_max_tokens_flag_reaches_the_runner_config() -> None:
    assert engine_config_from_args(_parse()).runner.piecewise_graph_max_tokens == 512  # on
    for value in (0, 16, 100, 2048):
        cfg = engine_config_from_args(_parse("--piecewise-graph-max-tokens", str(value)))
        assert cfg.runner.piecewise_graph_max_tokens == value


def test_llm_refuses_bad_piecewise_graph_max_tokens() -> None:
    with pytest.raises(ConfigError, match="piecewise_graph_max_tokens"):
        LLM(model="dummy:tiny", dtype="float32", max_model_len=256, piecewise_graph_max_tokens=8)


def test_gc_threshold_flag_reaches_the_scheduler_config() -> None:
    assert engine_config_from_args(_parse()).scheduler.gc_threshold == DEFAULT_GC_THRESHOLD
    cfg = engine_config_from_args(_parse("--gc-threshold", "1000,20,300"))
    assert cfg.scheduler.gc_threshold == (1000, 20, 300)
    assert engine_config_from_args(_parse("--gc-threshold", "none")).scheduler.gc_threshold is None
