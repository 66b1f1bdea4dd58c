"""KV block copies by copy engine (engine/dma_copy.py): the run splitting everywhere, the
copies themselves where a GPU is present (the H200 runs them; CI has none)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.config import ConfigError
from engine.dma_copy import (
    block_runs,
    copy_blocks_dma,
    dma_available,
    dma_requested,
    read_blocks_dma,
    write_blocks_dma,
)
from engine.runner.block_io import copy_cache_blocks
from engine.runner.model_build import resolve_device


def test_block_runs_merges_pairs_consecutive_on_both_sides() -> None:
    assert block_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    # consecutive on one side only: no run
    assert block_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert block_runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    assert block_runs([], []) == []


def test_block_runs_rejects_unequal_lists() -> None:
    with pytest.raises(ValueError, match="2 blocks to fill from 1"):
        block_runs([0, 1], [0])


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_block_runs_cover_every_pair_in_order(pairs: list[tuple[int, int]]) -> None:
    dst, src = [d for d, _ in pairs], [s for _, s in pairs]
    runs = block_runs(dst, src)
    expanded = [(d + i, s + i) for d, s, n in runs for i in range(n)]
    assert expanded == pairs
    # maximal: no two neighbouring runs could have been one
    for (d0, s0, n0), (d1, s1, _) in itertools.pairwise(runs):
        assert not (d1 == d0 + n0 and s1 == s0 + n0)


def test_a_dma_copy_needs_both_caches_on_one_device() -> None:
    cache = torch.zeros(2, 2, 4, 2, 1, 8)
    with pytest.raises(ValueError, match="both caches on one GPU"):
        copy_cache_blocks(cache, [0], cache.clone(), [1],
                          dma_streams=[None])  # type: ignore[list-item]


def test_dma_writes_check_the_blocks_before_any_copy() -> None:
    """Refused before the runtime is called (so on a CPU too): a DMA copy has no bounds."""
    cache = torch.zeros(2, 2, 4, 2, 1, 8, dtype=torch.bfloat16)
    blocks = torch.zeros(1, 2, 2, 2, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"contiguous torch\.bfloat16 blocks, got torch\.float32"):
        write_blocks_dma(cache, [0], blocks.float(), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strided"):
        write_blocks_dma(cache, [0], blocks.transpose(1, 2), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="for 2 blocks"):
        write_blocks_dma(cache, [0, 1], blocks, None)  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="destination block ids out of range"):
        write_blocks_dma(cache, [4], blocks, None)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_no_dma_without_a_cuda_runtime() -> None:
    assert not dma_available()


@pytest.mark.parametrize(("value", "wanted"), [(None, True), ("1", True), (" 0 ", False)])
def test_kv_dma_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                  wanted: bool) -> None:
    if value is None:
        monkeypatch.delenv("SPLITSERVE_KV_DMA", raising=False)
    else:
        monkeypatch.setenv("SPLITSERVE_KV_DMA", value)
    dma_requested.cache_clear()
    try:
        assert dma_requested() is wanted
        if not wanted:
            assert not dma_available()
    finally:
        dma_requested.cache_clear()


def test_kv_dma_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_KV_DMA", "yes")
    dma_requested.cache_clear()
    try:
        with pytest.raises(ConfigError, match="SPLITSERVE_KV_DMA must be 0 or 1, got 'yes'"):
            dma_requested()
    finally:
        dma_requested.cache_clear()


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_dma_copy_and_read_match_the_kernels_bit_for_bit(dtype: torch.dtype) -> None:
    assert dma_available()
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(0, 256, (3, 2, 40, 16, 2, 64), dtype=torch.uint8, device="cuda",
                        generator=gen).view(dtype)
    dst = torch.zeros(3, 2, 50, 16, 2, 64, dtype=torch.uint8, device="cuda").view(dtype)
    dst_ids, src_ids = [10, 11, 12, 3, 49, 48], [0, 1, 2, 39, 7, 8]
    stream = torch.cuda.Stream()
    copy_cache_blocks(dst, dst_ids, src, src_ids, dma_streams=[stream, torch.cuda.Stream()])
    raw_dst, raw_src = dst.view(torch.uint8), src.view(torch.uint8)
    assert torch.equal(raw_dst[:, :, dst_ids], raw_src[:, :, src_ids])
    untouched = [b for b in range(50) if b not in dst_ids]
    assert not raw_dst[:, :, untouched].any()

    host = torch.empty((len(src_ids), *src.shape[:2], *src.shape[3:]), dtype=dtype,
                       pin_memory=True)
    read_blocks_dma(src, src_ids, host, stream)
    stream.synchronize()
    assert torch.equal(host.view(torch.uint8),
                       raw_src[:, :, src_ids].permute(2, 0, 1, 3, 4, 5).cpu())


@needs_gpu
def test_dma_copies_refuse_block_ids_out_of_range() -> None:
    cache = torch.zeros(2, 2, 4, 16, 1, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(IndexError, match="source block ids out of range"):
        copy_blocks_dma(cache, [0], cache, [4], [torch.cuda.Stream()])
    with pytest.raises(IndexError, match="destination block ids out of range"):
        copy_blocks_dma(cache, [-1], cache, [0], [torch.cuda.Stream()])


@needs_gpu
@pytest.mark.parametrize("where", ["pinned", "pageable", "device"])
def test_dma_write_matches_the_blocks_bit_for_bit(where: str) -> None:
    cache = torch.zeros(3, 2, 50, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    ids = [7, 8, 9, 30, 2]
    blocks = torch.randn(len(ids), 3, 2, 16, 2, 64, dtype=torch.bfloat16)
    src = {"pinned": blocks.pin_memory(), "pageable": blocks, "device": blocks.cuda()}[where]
    stream = torch.cuda.Stream()
    write_blocks_dma(cache, ids, src, stream)
    stream.synchronize()
    assert torch.equal(cache[:, :, ids].permute(2, 0, 1, 3, 4, 5).cpu(), blocks)
    untouched = [b for b in range(50) if b not in ids]
    assert not cache[:, :, untouched].any()


@needs_gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_runner_writes_reads_and_copies_blocks_through_dma(kv_cache_dtype: str) -> None:
    """The runner's own paths (write_blocks from pinned host blocks, read_leased_blocks,
    copy_blocks_from another cache on this GPU) round-trip blocks exactly."""
    from engine import LLM

    llm = LLM(model="dummy:tiny", dtype="bfloat16", max_model_len=256,
              kv_cache_dtype=kv_cache_dtype, enforce_eager=True, gpu_memory_utilization=0.05)
    runner = llm.engine.runner
    n, d = 3, runner.kv_shape_per_block[-1] * runner.kv_dtype.itemsize
    blocks = torch.randint(0, 256, (n, *runner.kv_shape_per_block[:-1], d), dtype=torch.uint8)
    blocks = blocks.view(runner.kv_dtype).pin_memory()  # any bytes: compared as bytes
    last = runner.kv_cache.shape[2]  # blocks from the end: no request holds them
    ids = [last - 1, last - 3, last - 2]
    runner.write_blocks(ids, blocks)
    back = runner.read_leased_blocks(ids)
    assert torch.equal(back.view(torch.uint8), blocks.view(torch.uint8))
    runner.copy_blocks_from([last - 6, last - 5, last - 4], runner.kv_cache, ids)
    assert torch.equal(runner.kv_cache.view(torch.uint8)[:, :, [last - 6, last - 5, last - 4]],
                       runner.kv_cache.view(torch.uint8)[:, :, ids])


@needs_gpu
def test_runner_copies_another_cache_on_its_gpu_by_dma(caplog: pytest.LogCaptureFixture) -> None:
    """A cache mapped from another process is "cuda:0": a runner built on the default device
    must copy from it by copy engine on the side stream (it once fell back to the step stream's
    kernels, waiting for every queued step, on every same-GPU pull, because its device was a
    bare "cuda"; `resolve_device` now indexes it)."""
    from engine import LLM

    llm = LLM(model="dummy:tiny", dtype="bfloat16", max_model_len=256, enforce_eager=True,
              gpu_memory_utilization=0.05)
    runner = llm.engine.runner
    assert runner.device == torch.device("cuda", torch.cuda.current_device())
    assert resolve_device("cuda") == resolve_device("auto") == runner.device
    other = torch.randn_like(runner.kv_cache[:, :, :8])
    assert other.device == torch.device("cuda", torch.cuda.current_device())
    last = runner.kv_cache.shape[2]
    dst = [last - 3, last - 2, last - 1]
    with caplog.at_level(logging.DEBUG, logger="engine.dma_copy"):
        runner.copy_blocks_from(dst, other, [5, 6, 7])
    assert "KV copy: 3 blocks in 1 runs" in caplog.text
    assert torch.equal(runner.kv_cache[:, :, dst], other[:, :, 5:8])


@needs_gpu
@pytest.mark.parametrize("way", ["host_write", "device_copy"])
@pytest.mark.parametrize("fenced", [True, False])
def test_a_kv_load_lands_after_a_stale_write_from_a_launched_step(way: str, fenced: bool) -> None:
    """A step launched before a load's blocks were handed out may still write one of them (the
    K/V of a finished request's dropped token); the load, on the side stream, must land after
    that write, not before it (`ModelRunner.fence_kv_loads`).

    The unfenced case is the control: without the fence the side stream's copy does not wait
    for the step stream, and the stale write lands last (tools/probes/probe_side_stream_order.py on
    the H200: the copy done ~100 ms before the fill). The first DMA call of a process did wait
    (lazy loading synchronizes), which hid that from this test until it warmed up first."""
    from engine import LLM

    llm = LLM(model="dummy:tiny", dtype="bfloat16", max_model_len=256, enforce_eager=True,
              gpu_memory_utilization=0.05)
    runner = llm.engine.runner
    b = runner.kv_cache.shape[2] - 1
    blocks = torch.randn((1, *runner.kv_shape_per_block), dtype=torch.bfloat16).pin_memory()
    other = blocks.permute(1, 2, 0, 3, 4, 5).to("cuda").contiguous()  # a cache of one block

    def load() -> None:
        if way == "host_write":
            runner.write_blocks([b], blocks)
        else:
            runner.copy_blocks_from([b], other, [0])

    step = runner.step_stream or torch.cuda.current_stream()
    with torch.cuda.stream(step):  # warm up: the sleep kernel, the fill, the copy path
        torch.cuda._sleep(1000)
        runner.kv_cache[:, :, b].fill_(0)
    load()
    torch.cuda.synchronize()
    with torch.cuda.stream(step):
        torch.cuda._sleep(200_000_000)  # a step still running (~0.1 s)
        runner.kv_cache[:, :, b].fill_(0)  # its stale write into the freed block
    if fenced:
        runner.fence_kv_loads()  # the engine's thread: the load's blocks are handed out
    load()
    torch.cuda.synchronize()
    kept = torch.equal(runner.kv_cache[:, :, b].cpu(), blocks[0])
    assert kept is fenced, ("the load was overwritten by the step's stale write" if fenced else
                            "without the fence the load still landed last: this test cannot "
                            "tell a missing fence on this machine")


def test_resolve_device_names_the_gpu_by_index() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda").index == torch.cuda.current_device()
        assert resolve_device("cuda:0") == torch.device("cuda", 0)
    else:
        assert resolve_device("auto") == torch.device("cpu")
