"""Piecewise graphs (engine/piecewise_graphs.py) on the CPU: the pieces run uncaptured on their
static buffers (`capture=False`), so what is checked is the layout: where the layers are cut
around attention, the buffers handed between pieces, padding rows up to a bucket, and which
steps the runner sends through it. Capture itself is checked on the GPU
(tools/gpu/gpu_engine_check.py compares every configuration with the torch path there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ConfigError, RunnerConfig
from engine.llm_engine import LLMEngine
from engine.piecewise_graphs import PiecewiseGraphRunner, piecewise_buckets
from engine.runner import ModelRunner
from engine.scheduler import SchedulerOutput

# Importing test_kernels turns the interpreter on for the kernel modules; `_interpret` is its
# autouse fixture (re-exported so that it applies to this module's tests too).
from tests.kernels.test_kernels import _interpret  # noqa: F401
from tests.support.engine_driver import Trace, drive, greedy, tiny_llm


def test_buckets() -> None:
    assert piecewise_buckets(16) == [16]
    assert piecewise_buckets(100) == [16, 32, 64, 100]
    assert piecewise_buckets(512) == [16, 32, 64, 128, 256, 384, 512]
    assert piecewise_buckets(600) == [16, 32, 64, 128, 256, 384, 512, 600]


@pytest.mark.parametrize("value", [-1, 1, 15, 4096, 1.5])
def test_config_refuses_bad_max_tokens(value: object) -> None:
    with pytest.raises(ConfigError, match="piecewise_graph_max_tokens"):
        RunnerConfig(piecewise_graph_max_tokens=value).validate()  # type: ignore[arg-type]


def test_no_pieces_without_graphs(tiny_model_dirs: dict[str, Path]) -> None:
    """On the CPU (no CUDA graphs) the runner builds none: steps run `model.forward`."""
    llm = tiny_llm(tiny_model_dirs["llama"])
    assert llm.engine.runner.piecewise is None


@torch.inference_mode()
def _piecewise_logits(runner: ModelRunner, out: SchedulerOutput) -> torch.Tensor:
    """`ModelRunner.logits_for` through the pieces instead of `model.forward`."""
    assert runner.piecewise is not None
    input_ids, positions, md, _ = runner.prepare(out)
    assert runner.piecewise.can_run(len(input_ids)), "the step must fit a bucket"
    hidden = runner.piecewise.run(input_ids, positions, md)
    assert hidden.shape[0] == len(input_ids)
    return runner.model.compute_logits(hidden)


def _traces(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int
            ) -> tuple[dict[str, Trace], int]:
    """Every position's logits, prompts added one step apart (so that later prompts share a
    step with earlier ones' decodes); and the number of steps."""
    traces: dict[str, Trace] = {}
    steps = 0
    pending = list(prompts.items())
    rid, prompt = pending.pop(0)
    engine.add_request(rid, prompt, greedy(max_tokens))
    for _ in drive(engine, traces):
        steps += 1
        if pending:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, greedy(max_tokens))
    return traces, steps


# Qwen3 on Triton: tests/kernels/test_qwen3_triton.py (the interpreter is slow).
@pytest.mark.parametrize(("backend", "name", "kv"), [
    ("torch", "llama", "auto"), ("triton", "llama", "auto"), ("torch", "qwen3", "auto"),
    ("torch", "gemma2", "auto"), ("torch", "llama", "int8"), ("torch", "qwen3", "int8")])
def test_every_position_matches_the_model_forward(tiny_model_dirs: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  backend: str, name: str, kv: str) -> None:
    """Prompts (fresh, a prefix hit's tail, chunks of a long one), decodes beside them, each step
    padded up to 16 or 32 rows: the same logits as the model's own forward pass. With the Triton
    backend RoPE rotates q and k in place, inside the pieces' static QKV buffer (Qwen3: q and k
    normalised out of place first, then copied back into it). An int8 cache's channel factors
    scale q, k, v inside the pieces and the output outside them (v in place, in the buffer a
    fresh prompt's SDPA reads: tests/kernels/test_rope_kv_write.py checks the in-place
    scaling)."""
    prompts = {
        "a": [5, 17, 99, 3, 8],
        "b": [250, 7, 42, 8, 300, 11, 64, 9, 2],
        "c": [(13 * i + 7) % 300 + 1 for i in range(21)],
        "again": [250, 7, 42, 8, 300, 11, 64, 9, 31, 77, 4],  # b's first 8 tokens cached
    }
    kwargs = dict(attention_backend=backend, max_model_len=64, max_num_batched_tokens=24,
                  kv_cache_dtype=kv)
    n = 4 if backend == "torch" else 2  # the interpreter is slow
    if backend == "triton":  # a fresh prompt, one beside a decode, a prefix hit's tail
        prompts = {rid: prompts[rid] for rid in ("a", "b", "again")}
    want, _ = _traces(tiny_llm(tiny_model_dirs[name], **kwargs).engine, prompts, n)

    llm = tiny_llm(tiny_model_dirs[name], **kwargs)
    runner = llm.engine.runner
    assert (runner.kv_channel_factors is not None) == (kv == "int8")
    runner.piecewise = PiecewiseGraphRunner(runner, 32, capture=False)
    monkeypatch.setattr(runner, "logits_for", lambda out: _piecewise_logits(runner, out))
    got, steps = _traces(llm.engine, prompts, n)
    assert runner.piecewise.num_steps == steps
    for rid in prompts:
        start = 8 if rid == "again" else 0
        torch.testing.assert_close(got[rid].logits_matrix(start), want[rid].logits_matrix(start),
                                   atol=1e-5, rtol=1e-5, msg=rid)
    llm.engine.scheduler.check_integrity()


def test_engine_steps_take_the_pieces_up_to_their_largest_bucket(
        tiny_model_dirs: dict[str, Path]) -> None:
    """`ModelRunner.launch` sends a step of at most 16 tokens through the pieces and a bigger one
    through `model.forward`; greedy tokens as an engine without them."""
    prompts = {"short": [5, 17, 99, 3, 8, 41], "long": [(7 * i + 3) % 300 + 1 for i in range(20)]}
    ref = tiny_llm(tiny_model_dirs["llama"], max_model_len=64).engine
    engine = tiny_llm(tiny_model_dirs["llama"], max_model_len=64).engine
    pieces = engine.runner.piecewise = PiecewiseGraphRunner(engine.runner, 16, capture=False)

    def generate(e: LLMEngine, rid: str) -> list[int]:
        e.add_request(rid, prompts[rid], greedy(5))
        tokens: list[int] = []
        while e.has_unfinished_requests():
            for o in e.step():
                tokens.extend(o.new_token_ids)
        return tokens

    for rid in prompts:
        before = pieces.num_steps
        assert generate(engine, rid) == generate(ref, rid), rid
        # The short prompt's step and its 4 one-token decode steps (no decode graphs on the
        # CPU, so they are eager steps too); the long prompt's first step runs unpieced.
        assert pieces.num_steps - before == (5 if rid == "short" else 4), rid
    engine.scheduler.check_integrity()
