"""Load shedding in the serving engine (`SchedulerConfig.max_queued_requests`): AsyncEngine
refuses a request once `max_num_seqs + max_queued_requests` are in flight, before anything is
queued, and takes requests again as they finish. The real tiny model on the CPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine, EngineOverloadedError
from engine.config import ConfigError, EngineConfig, LoadConfig, RunnerConfig, SchedulerConfig
from engine.llm import LLM
from engine_api.request_options import RequestOptions
from engine_api.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 7], [42, 8, 300, 11, 4], [9, 9, 120, 33, 61, 2, 18]]


def _engine(path: Path, max_queued: int | None, policy: str = "fcfs") -> AsyncEngine:
    llm = LLM.from_config(EngineConfig(
        load=LoadConfig(model=str(path), dtype="float32"),
        scheduler=SchedulerConfig(max_num_seqs=1, max_queued_requests=max_queued,
                                  policy=policy),  # type: ignore[arg-type]
        runner=RunnerConfig(device="cpu")))
    return AsyncEngine(llm.engine)


def test_capacity_refuses_then_recovers(tiny_model_dirs: dict[str, Path]) -> None:
    aeng = _engine(tiny_model_dirs["llama"], max_queued=1)
    assert aeng.capacity == 2
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main() -> tuple[str, list[int], int]:
        aeng.start()
        try:
            started = asyncio.Event()

            async def run(rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
                toks: list[int] = []
                async for out in aeng.generate(rid, prompt, RequestOptions(params)):
                    toks.extend(out.new_token_ids)
                    started.set()
                return toks

            first = asyncio.create_task(run("a", PROMPTS[0], long))   # running
            second = asyncio.create_task(run("b", PROMPTS[1], long))  # waiting
            await started.wait()
            assert aeng.num_in_flight == 2
            with pytest.raises(EngineOverloadedError, match="at most 2"):
                async for _ in aeng.generate("c", PROMPTS[2], RequestOptions(short)):
                    pass
            assert aeng.num_in_flight == 2  # the refused request left nothing behind
            a, _ = await asyncio.gather(first, second)
            after = [t async for out in aeng.generate("d", PROMPTS[2], RequestOptions(short))
                     for t in out.new_token_ids]
            await aeng.call(lambda: None)
            return "ok", a, len(after)
        finally:
            await aeng.stop()

    status, a, n_after = asyncio.run(main())
    assert status == "ok" and len(a) == 40 and n_after == 3
    assert aeng.num_in_flight == 0
    assert not aeng.engine.kv.req_to_blocks  # every block came back
    aeng.engine.scheduler.check_integrity()


def test_full_priority_engine_displaces_a_less_urgent_waiting_request(
        tiny_model_dirs: dict[str, Path]) -> None:
    """One seat, one queue place: an urgent arrival takes the place of a less urgent request
    that never ran (its stream ends in EngineOverloadedError); equal or less urgent arrivals
    are refused."""
    aeng = _engine(tiny_model_dirs["llama"], max_queued=1, policy="priority")
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)  # outlasts the rest
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main() -> dict[str, object]:
        aeng.start()
        try:
            started = asyncio.Event()

            async def run(rid: str, params: SamplingParams, prio: int) -> list[int] | str:
                toks: list[int] = []
                try:
                    async for out in aeng.generate(rid, PROMPTS[len(rid) % 3],
                                                   RequestOptions(params, priority=prio)):
                        toks.extend(out.new_token_ids)
                        started.set()
                except EngineOverloadedError as e:
                    return str(e)
                return toks

            running = asyncio.create_task(run("a", long, 0))
            await started.wait()
            waiting = asyncio.create_task(run("bb", long, 5))
            await aeng.call(lambda: None)  # "bb" is queued in the engine
            urgent = asyncio.create_task(run("ccc", short, 1))
            displaced = await waiting
            refused_equal = await run("dddd", short, 1)   # "ccc" (1) holds the place now
            refused_lazy = await run("e", short, 9)
            return {"a": await running, "bb": displaced, "ccc": await urgent,
                    "equal": refused_equal, "lazy": refused_lazy}
        finally:
            await aeng.stop()

    got = asyncio.run(main())
    assert isinstance(got["a"], list) and len(got["a"]) == 120
    assert isinstance(got["bb"], str) and "displaced by a more urgent request" in got["bb"]
    assert isinstance(got["ccc"], list) and len(got["ccc"]) == 3
    assert isinstance(got["equal"], str) and "at most 2" in got["equal"]
    assert isinstance(got["lazy"], str) and "at most 2" in got["lazy"]
    assert not aeng.engine.kv.req_to_blocks
    aeng.engine.scheduler.check_integrity()


def test_no_bound_by_default(tiny_model_dirs: dict[str, Path]) -> None:
    aeng = _engine(tiny_model_dirs["llama"], max_queued=None)
    assert aeng.capacity is None
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def main() -> list[list[int]]:
        aeng.start()
        try:
            async def run(i: int) -> list[int]:
                return [t async for out in aeng.generate(f"r{i}", PROMPTS[i % len(PROMPTS)],
                                                         RequestOptions(params)) for t in out.new_token_ids]
            return await asyncio.gather(*(run(i) for i in range(8)))
        finally:
            await aeng.stop()

    assert all(len(t) == 2 for t in asyncio.run(main()))


def test_bound_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_queued_requests"):
        SchedulerConfig(max_queued_requests=-1).validate()
    with pytest.raises(ConfigError, match="max_queued_requests"):
        SchedulerConfig(max_queued_requests=1.5).validate()  # type: ignore[arg-type]
