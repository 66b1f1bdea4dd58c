"""Priority scheduling (engine/request_queue.py, `SchedulerConfig.policy = "priority"`): queue
order, which request a preemption takes, admission of an urgent request by preempting less
urgent ones, and the engine's checks. The scheduler runs on a real KV cache manager; the last
test runs the real tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, SchedulerConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.llm import LLM
from engine.request import Request, RequestStatus
from engine.request_queue import WaitingQueue, insert_running, priority_key
from engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from engine_api.errors import EngineInputError
from engine_api.sampling_params import SamplingParams
from tests.support.engine_driver import greedy

BS = 4
ROOT = b"\x03" * 32


def _sched(policy: str = "priority", budget: int = 64, blocks: int = 64,
           max_num_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=64, policy=policy)  # type: ignore[arg-type]
    return Scheduler(cfg, KVCacheManager(blocks, BS, True, ROOT), max_model_len=64)


def _req(rid: str, n: int = 4, priority: int = 0, arrival: float = 0.0,
         max_tokens: int = 8) -> Request:
    return Request(rid, [(i * 5 + len(rid)) % 50 for i in range(n)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_model_len=64,
                   arrival_time=arrival, priority=priority)


def _step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {x.request.request_id: SampledToken(1)
                               for x in out.scheduled if x.sample})
    s.check_integrity()
    return out


def _ids(reqs: object) -> list[str]:
    return [r.request_id for r in reqs]  # type: ignore[attr-defined]


def test_waiting_queue_orders_by_priority_then_arrival() -> None:
    q = WaitingQueue("priority")
    reqs = [_req("late-urgent", priority=-1, arrival=5.0), _req("a0", arrival=1.0),
            _req("b0", arrival=2.0), _req("lazy", priority=7, arrival=0.0),
            _req("early-urgent", priority=-1, arrival=3.0)]
    for seq, r in enumerate(reqs):
        r.queue_seq = seq
        q.add(r)
    assert _ids(q) == ["early-urgent", "late-urgent", "a0", "b0", "lazy"]
    q.remove(reqs[2])  # b0
    assert q.pop().request_id == "early-urgent"
    q.requeue(reqs[4])  # back at its place, not at the front
    assert _ids(q) == ["early-urgent", "late-urgent", "a0", "lazy"]
    assert len(q) == 4 and reqs[3] in q and reqs[2] not in q


def test_fcfs_queue_keeps_arrival_order_and_requeues_at_the_front() -> None:
    q = WaitingQueue("fcfs")
    a, b, c = _req("a", priority=9), _req("b"), _req("c")
    for r in (a, b, c):
        q.add(r)
    assert q.peek() is a  # priorities are not looked at
    q.pop()
    q.requeue(a)
    assert _ids(q) == ["a", "b", "c"]


def test_equal_keys_keep_admission_order() -> None:
    q = WaitingQueue("priority")
    reqs = [_req(f"r{i}", arrival=1.0) for i in range(4)]
    for seq, r in enumerate(reqs):
        r.queue_seq = seq
        q.add(r)
    assert _ids(q) == ["r0", "r1", "r2", "r3"]
    running: list[Request] = []
    for r in reversed(reqs):
        insert_running(running, r, "priority")
    assert _ids(running) == ["r0", "r1", "r2", "r3"]
    assert sorted(reqs, key=priority_key) == reqs


def test_running_list_keeps_the_least_urgent_last() -> None:
    s = _sched(max_num_seqs=8)
    for rid, prio in (("p5", 5), ("p0", 0), ("p-2", -2), ("p5b", 5)):
        s.add_request(_req(rid, priority=prio))
    out = _step(s)
    assert _ids(s.running) == ["p-2", "p0", "p5", "p5b"]
    # The step's prefills in the same order: the budget reaches the urgent ones first.
    assert [x.request.request_id for x in out.scheduled] == ["p-2", "p0", "p5", "p5b"]


def test_budget_goes_to_the_urgent_prompt_first() -> None:
    s = _sched(budget=8)
    s.add_request(_req("bulk", n=20, priority=1, arrival=0.0))
    s.add_request(_req("urgent", n=6, priority=0, arrival=1.0))
    out = _step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [
        ("urgent", 6), ("bulk", 2)]


def test_preemption_takes_the_least_urgent() -> None:
    # 6 blocks of 4 slots: three 7-token prompts growing to 15 tokens cannot all stay.
    s = _sched(blocks=6)
    reqs = {rid: _req(rid, n=7, priority=p, arrival=t, max_tokens=8)
            for rid, p, t in (("low", 3, 0.0), ("high", 0, 1.0), ("mid", 1, 2.0))}
    for r in reqs.values():
        s.add_request(r)
    preempted: list[str] = []
    for _ in range(60):
        if not s.has_work():
            break
        preempted += _step(s).preempted_ids
    assert preempted and "high" not in preempted
    assert preempted[0] == "low"  # the least urgent goes first, though it arrived first
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs.values())
    assert reqs["high"].num_preemptions == 0
    assert s.kv.num_free_blocks == 6


def test_urgent_request_preempts_less_urgent_for_a_seat() -> None:
    s = _sched(max_num_seqs=2)
    a, b = _req("bulk-a", priority=5, arrival=0.0), _req("bulk-b", priority=5, arrival=1.0)
    s.add_request(a)
    s.add_request(b)
    _step(s)
    assert _ids(s.running) == ["bulk-a", "bulk-b"]
    s.add_request(_req("urgent", priority=0, arrival=2.0))
    out = _step(s)
    assert out.preempted_ids == ["bulk-b"]  # the newest of the least urgent
    assert "urgent" in [x.request.request_id for x in out.scheduled]
    assert _ids(s.running) == ["urgent", "bulk-a"]
    assert _ids(s.waiting) == ["bulk-b"]
    # An equal priority waits for its turn instead.
    s.add_request(_req("also-5", priority=5, arrival=3.0))
    out = _step(s)
    assert out.preempted_ids == [] and _ids(s.running) == ["urgent", "bulk-a"]


def test_urgent_request_preempts_less_urgent_for_blocks() -> None:
    s = _sched(blocks=8, max_num_seqs=8)  # 32 slots
    bulk = _req("bulk", n=24, priority=2, max_tokens=4)
    s.add_request(bulk)
    _step(s)
    urgent = _req("urgent", n=16, priority=0, arrival=1.0, max_tokens=2)
    s.add_request(urgent)
    out = _step(s)
    assert out.preempted_ids == ["bulk"]
    assert [x.request.request_id for x in out.scheduled] == ["urgent"]
    for _ in range(20):
        if not s.has_work():
            break
        _step(s)
    assert urgent.status == bulk.status == RequestStatus.FINISHED_LENGTH
    assert bulk.num_output_tokens == 4 and s.kv.num_free_blocks == 8


def test_fcfs_policy_refuses_priorities() -> None:
    s = _sched(policy="fcfs")
    with pytest.raises(ValueError, match="priority"):
        s.add_request(_req("x", priority=1))
    with pytest.raises(ConfigError, match="scheduling policy"):
        SchedulerConfig(policy="lifo").validate()  # type: ignore[arg-type]


def test_engine_priorities_change_order_not_outputs(tiny_model_dirs: dict[str, Path]) -> None:
    """The tiny model at one sequence a step: the urgent prompts finish first, and every
    output equals the same prompt's under FCFS."""
    path = tiny_model_dirs["llama"]
    prompts = [[3 + i, 17, 42 + i, 8, 99] for i in range(4)]
    kw = dict(dtype="float32", max_model_len=64, max_num_seqs=1, device="cpu",
              enforce_eager=True)
    fcfs = LLM(str(path), **kw)  # type: ignore[arg-type]
    want = [o.outputs[0].token_ids for o in fcfs.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(6))]
    with pytest.raises(EngineInputError, match="first come, first served"):
        fcfs.generate([{"prompt_token_ids": prompts[0]}], greedy(2), priority=[1])
    fcfs.shutdown()
    llm = LLM(str(path), scheduling_policy="priority", **kw)  # type: ignore[arg-type]
    with pytest.raises(EngineInputError, match="32-bit"):
        llm.generate([{"prompt_token_ids": prompts[0]}], greedy(2), priority=[2**31])
    with pytest.raises(EngineInputError, match="priorities"):
        llm.generate([{"prompt_token_ids": prompts[0]}], greedy(2), priority=[0, 1])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6),
                        priority=[3, 0, 2, -1])
    assert [o.outputs[0].token_ids for o in outs] == want
    done: dict[str, float] = {}
    for o in outs:
        assert o.metrics is not None and o.metrics.finished_time is not None
        done[o.request_id] = o.metrics.finished_time
    order = sorted(done, key=done.__getitem__)
    assert order == [outs[3].request_id, outs[1].request_id, outs[2].request_id,
                     outs[0].request_id]
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_by_priority_resumes_exactly(tiny_model_dirs: dict[str, Path],
                                               async_scheduling: bool) -> None:
    """Less urgent requests decoding (tokens in flight under async scheduling) are preempted
    for urgent arrivals, recompute, and finish with the tokens they would have had alone."""
    path = tiny_model_dirs["llama"]
    prompts = [[7 + i, 30, 2 * i + 1, 64, 5, 11] for i in range(6)]
    alone = LLM(str(path), dtype="float32", max_model_len=64, device="cpu", block_size=4)
    want = [o.outputs[0].token_ids for o in alone.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(12))]
    alone.shutdown()
    llm = LLM(str(path), dtype="float32", max_model_len=64, device="cpu", block_size=4,
              max_num_seqs=3, scheduling_policy="priority", async_scheduling=async_scheduling)
    eng = llm.engine
    reqs = [eng.add_request(f"bulk{i}", prompts[i], greedy(12), priority=4) for i in range(3)]
    for _ in range(5):
        eng.step()
    assert all(r.num_output_tokens >= 2 for r in reqs)  # decoding when the urgent ones come
    reqs += [eng.add_request(f"urgent{i}", prompts[i], greedy(12), priority=-1)
             for i in range(3, 6)]
    preempted_before = eng.scheduler.num_preemptions
    for _ in range(200):
        if not eng.has_unfinished_requests():
            break
        eng.step()
        eng.scheduler.check_integrity()
    assert eng.scheduler.num_preemptions - preempted_before == 3
    assert [r.output_token_ids for r in reqs] == want
    urgent_done = max(r.metrics.finished_time or 0.0 for r in reqs[3:])
    assert all((r.metrics.finished_time or 0.0) > urgent_done for r in reqs[:3])
    assert not eng.kv.req_to_blocks
    llm.shutdown()
