"""The engine's startup heap and the garbage collector: frozen after start, given back before
the next engine sizes its KV cache."""

from __future__ import annotations

import atexit
import gc
import os

# "0" turns the freeze off, and with it the full collection before it (~0.2 s in a process with
# torch loaded). For processes that build many short-lived engines, where that costs more than
# the pauses the freeze saves: the test suite builds ~360. The collection at the next start
# (`thaw_heap`) stays: it frees the engines dropped since, whose cycles would otherwise wait
# for a full collection the raised thresholds make rare.
GC_FREEZE_ENV = "SPLITSERVE_GC_FREEZE"

# Whether an engine's start froze the heap: only then do the next start and `shutdown` unfreeze
# it. With the freeze off, a heap the process froze itself (the test suite freezes what its
# collection imported) stays frozen, and each start's collection walks only the rest (0.34 s
# -> ~0 s for the suite's imports on 2 cores). With it on, giving the engine's freeze back
# unfreezes the process's too: the collector has one frozen generation.
_frozen_by_engine = False


def freeze_enabled() -> bool:
    return os.environ.get(GC_FREEZE_ENV, "1") != "0"


def thaw_heap() -> None:
    """Give frozen objects back to the garbage collector and collect.

    Frees the reference cycles of engines dropped since the last freeze, and with them the
    device memory they hold (a frozen cycle is never collected). Runs before an engine sizes its
    KV cache from the free device memory (with the freeze off too: `GC_FREEZE_ENV`)."""
    unfreeze_startup_heap()
    gc.collect()


def unfreeze_startup_heap() -> None:
    """Give the heap an engine's start froze back to the garbage collector (no-op when no
    engine froze it: a freeze of the process's own stays)."""
    global _frozen_by_engine
    if _frozen_by_engine:
        gc.unfreeze()
        _frozen_by_engine = False


def freeze_startup_heap(gc_threshold: tuple[int, int, int] | None = None) -> None:
    """Move every object alive now out of the garbage collector's reach, and set `gc_threshold`
    (`SchedulerConfig.gc_threshold`; None leaves the thresholds as they are).

    What an engine builds at start (module and parameter wrappers, one object per KV block,
    captured graphs) lives as long as the engine, but each full collection walked all of it:
    on an H200 host with 56k KV blocks, 12 full collections paused one offline run for 2.5 s
    (~0.2 s each), 3.7 s of 116 s with the younger generations
    (bench/results/h200/probe_tput_bf16_c2dcc73.json -> gc; 1.8 s after the freeze,
    probe_tput_bf16_796b7d4.json). vLLM freezes its startup heap the same way. The next
    engine's start (`thaw_heap`) or `LLMEngine.shutdown` gives it back. At exit the heap is
    unfrozen too, so the interpreter's last collection finalises it (extension modules such as
    Triton's report frozen objects as leaks otherwise).
    """
    global _unfreeze_at_exit, _frozen_by_engine
    if gc_threshold is not None:
        gc.set_threshold(*gc_threshold)
    if not freeze_enabled():
        return
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    gc.collect()
    gc.freeze()
    _frozen_by_engine = True


_unfreeze_at_exit = False
