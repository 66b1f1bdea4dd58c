"""Async scheduling (step n+1 scheduled and launched before step n's tokens reach the host) gives
exactly what synchronous scheduling gives: tokens, stops, logprobs, seeded sampling, preemption,
aborts, penalties and min_tokens (whose sampling waits for the previous step's tokens between
the next forward pass and its sampling), and no leaked KV blocks.

The tiny float32 Llama on the CPU is deterministic, so the two modes must agree token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.config import SchedulerConfig
from engine.outputs import StepOutput
from engine_api.request_options import RequestOptions
from tests.support.engine_driver import run_steps, step_tokens, tiny_llm

PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([5, 23, 9, 40, 2])]


def _run(llm: LLM, params: list[SamplingParams], abort_after: dict[str, int] | None = None
         ) -> tuple[dict[str, list[StepOutput]], int]:
    return run_steps(llm, PROMPTS, params, abort_after, max_steps=500)


_tokens = step_tokens


def _pair(path: Path, **kwargs: Any) -> tuple[LLM, LLM]:
    return (tiny_llm(path, async_scheduling=False, **kwargs),
            tiny_llm(path, async_scheduling=True, **kwargs))


def _count_inflight_inputs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts prepared steps that took an input token from the device (never from the host)."""
    runner = llm.engine.runner
    real = runner.inputs.last_sampled_row
    calls: list[int] = []

    def spy(request_id: str) -> int:
        calls.append(1)
        return real(request_id)

    monkeypatch.setattr(runner.inputs, "last_sampled_row", spy)
    return calls


def test_async_matches_sync_greedy_lengths_and_stops(tiny_model_dirs: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sync, fast = _pair(tiny_model_dirs["llama"])
    assert fast.engine.async_scheduling and not sync.engine.async_scheduling
    base = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 3, 1, 20, 7)]
    want, _ = _run(sync, base)
    # Stop on a token that greedy decoding really produces mid-sequence (the 5th of r3).
    stop_tok = _tokens(want)["r3"][4]
    params = [*base[:3], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]),
              base[4]]
    want, sync_steps = _run(sync, params)
    gathered = _count_inflight_inputs(fast, monkeypatch)
    got, fast_steps = _run(fast, params)
    assert _tokens(got) == _tokens(want)
    assert _tokens(got)["r3"][-1] == stop_tok
    assert [o[-1].finish_reason for o in got.values()] == [o[-1].finish_reason for o in want.values()]
    assert sum(gathered) > 0  # inputs really came from the device-side tokens
    assert fast_steps <= sync_steps + 1  # one extra step at most: the last one's completion


def test_async_matches_sync_with_logprobs_seeds_and_penalties(
        tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    sync, fast = _pair(tiny_model_dirs["llama"])
    gathered = _count_inflight_inputs(fast, monkeypatch)
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, min_tokens=4),
        SamplingParams(temperature=1.0, seed=5, max_tokens=9, ignore_eos=True, logprobs=0),
    ]
    want, _ = _run(sync, params)
    got, _ = _run(fast, params)
    assert _tokens(got) == _tokens(want)
    # The penalized requests did not make their steps synchronous: inputs came from the device.
    assert sum(gathered) > 0
    for rid in want:
        lw = [lp for o in want[rid] for lp in o.new_logprobs]
        lg = [lp for o in got[rid] for lp in o.new_logprobs]
        assert lw == lg


def test_async_preemption_and_abort(tiny_model_dirs: dict[str, Path]) -> None:
    # 24 blocks of 4 tokens cannot hold all five sequences: later ones get preempted.
    sync, fast = _pair(tiny_model_dirs["llama"], num_gpu_blocks=24)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 25, 30, 20, 30)]
    want, _ = _run(sync, params, abort_after={"r2": 4})
    got, _ = _run(fast, params, abort_after={"r2": 4})
    assert sync.engine.scheduler.num_preemptions > 0 and fast.engine.scheduler.num_preemptions > 0
    assert _tokens(got) == _tokens(want)
    assert len(_tokens(got)["r2"]) == 4


def test_auto_is_off_on_cpu_and_never_in_the_prefill_role(tiny_model_dirs: dict[str, Path]) -> None:
    from engine.config import EngineConfig, LoadConfig, RunnerConfig

    assert not tiny_llm(tiny_model_dirs["llama"]).engine.async_scheduling
    cfg = EngineConfig(load=LoadConfig(model=str(tiny_model_dirs["llama"]), dtype="float32"),
                       scheduler=SchedulerConfig(role="prefill", async_scheduling=True),
                       runner=RunnerConfig(device="cpu"))
    assert not LLM.from_config(cfg).engine.async_scheduling


def test_async_engine_thread_streams_and_cancels(tiny_model_dirs: dict[str, Path]) -> None:
    """The serving path: AsyncEngine's thread drives an async-scheduling engine; concurrent
    streams get the synchronous engine's tokens, a cancelled one frees its KV."""
    import asyncio

    from engine.async_engine import AsyncEngine

    sync = tiny_llm(tiny_model_dirs["llama"], async_scheduling=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 3, 11, 6, 9)]
    want, _ = _run(sync, params)
    fast = tiny_llm(tiny_model_dirs["llama"], async_scheduling=True)

    async def main() -> dict[str, list[int]]:
        aeng = AsyncEngine(fast.engine)
        aeng.start()

        async def one(i: int) -> list[int]:
            toks: list[int] = []
            async for o in aeng.generate(f"r{i}", PROMPTS[i], RequestOptions(params[i])):
                toks.extend(o.new_token_ids)
                if i == 4 and len(toks) == 2:
                    break  # the consumer goes away: the engine must abort and free its blocks
            return toks

        try:
            got = await asyncio.gather(*(one(i) for i in range(5)))
            await aeng.call(lambda: None)  # let the abort land
            return {f"r{i}": t for i, t in enumerate(got)}
        finally:
            await aeng.stop()

    got = asyncio.run(main())
    expected = _tokens(want)
    assert {k: v for k, v in got.items() if k != "r4"} == {k: v for k, v in expected.items()
                                                          if k != "r4"}
    assert got["r4"] == expected["r4"][:2]
    fast.engine.scheduler.check_integrity()
    assert not fast.engine.kv.req_to_blocks
