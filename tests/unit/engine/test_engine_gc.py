"""The engine moves its startup heap out of the garbage collector's reach (freeze_startup_heap)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from engine import LLM
from engine.config import DEFAULT_GC_THRESHOLD, ConfigError
from engine.heap import GC_FREEZE_ENV, unfreeze_startup_heap
from engine.llm_engine import LLMEngine


@pytest.fixture(autouse=True)
def _freeze_on(unfrozen_heap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The freeze as a server runs it (tests/conftest.py turns it off for the rest), from a
    heap nothing froze (tests/conftest.py freezes the suite's imports for the rest)."""
    monkeypatch.setenv(GC_FREEZE_ENV, "1")


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _build(**kwargs: Any) -> LLM:
    return LLM(model="dummy:tiny", dtype="float32", max_model_len=256, max_num_seqs=4,
               max_num_batched_tokens=64, enforce_eager=True, **kwargs)


def test_engine_start_freezes_its_heap() -> None:
    llm = _build()
    assert gc.get_freeze_count() > 0
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}])  # still serves after the freeze
    assert len(out[0].outputs[0].token_ids) > 0


def test_freeze_off_freezes_nothing_but_sets_the_thresholds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gc.unfreeze()
    monkeypatch.setenv(GC_FREEZE_ENV, "0")
    gc.set_threshold(700, 10, 10)
    llm = _build()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == DEFAULT_GC_THRESHOLD
    gc.set_threshold(*DEFAULT_GC_THRESHOLD)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}])[0].outputs[0].token_ids) > 0


def test_freeze_off_leaves_a_freeze_of_the_process_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the freeze off, an engine gives back no freeze it did not make: what the process
    froze itself (the test suite freezes its imports) stays frozen through the engine's start
    and shutdown."""
    unfreeze_startup_heap()  # the earlier tests' engines' freeze
    monkeypatch.setenv(GC_FREEZE_ENV, "0")
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    gc.freeze()  # the process's own
    del cycle
    _build().shutdown()
    gc.collect()
    assert ref() is not None, "the engine unfroze the process's heap"
    gc.unfreeze()
    gc.collect()
    assert ref() is None


def test_engine_start_makes_full_collections_rarer() -> None:
    """A full collection walks every live request's token lists (tools/probes/probe_gc.py): by default
    the engine keeps CPython's young thresholds and raises the old generation's; `gc_threshold`
    sets others, None leaves them."""
    gc.set_threshold(700, 10, 10)
    _build()
    assert gc.get_threshold() == DEFAULT_GC_THRESHOLD
    assert DEFAULT_GC_THRESHOLD[:2] == (700, 10) and DEFAULT_GC_THRESHOLD[2] > 10
    _build(gc_threshold=(2000, 20, 200))
    assert gc.get_threshold() == (2000, 20, 200)
    gc.set_threshold(700, 10, 10)
    _build(gc_threshold=None)
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(ConfigError, match="gc_threshold"):
        _build(gc_threshold=(700, -1, 10))
    gc.set_threshold(*DEFAULT_GC_THRESHOLD)


def test_cycles_frozen_by_an_earlier_engine_are_freed_by_the_next() -> None:
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    _build()  # freezes `cycle` with everything else alive
    del cycle
    gc.collect()
    assert ref() is not None, "a frozen cycle is not collected"
    _build()  # unfreezes, collects, freezes again
    assert ref() is None


def test_shutdown_lets_a_dropped_engine_be_collected() -> None:
    def dropped(shutdown: bool) -> weakref.ref[LLMEngine]:
        llm = _build()
        engine = llm.engine
        engine.me = engine  # type: ignore[attr-defined]  # a cycle through the frozen engine
        if shutdown:
            llm.shutdown()
        ref = weakref.ref(engine)
        del llm, engine
        gc.collect()
        return ref

    assert dropped(shutdown=False)() is not None  # frozen: a collection does not reach it
    assert dropped(shutdown=True)() is None


def test_shutdown_gives_back_the_kv_cache_and_weights_and_refuses_steps() -> None:
    llm = _build()
    runner = llm.engine.runner
    assert runner.kv_cache.numel() > 0
    llm.shutdown()
    assert runner.kv_cache.numel() == 0 and not runner.kv_caches
    assert all(p.is_meta for p in runner.model.parameters())
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}])
