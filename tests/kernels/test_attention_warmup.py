"""The attention warm-up covers every compiled form an eager step can pick, and runs
(TRITON_INTERPRET=1, CPU: the interpreter compiles nothing, so only coverage and the launches
themselves are checked here; on the GPU, tools/probes/probe_tput.py logs the compiles of a run)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_kernels import _interpret  # noqa: F401

# Importing test_kernels turns the interpreter on for the kernel modules; `_interpret` is its
# autouse fixture (re-exported so that it applies to this module's tests too).
from tests.support.interpret import interpreted_kernel_imports

with interpreted_kernel_imports():
    from engine.attention import warmup
    from engine.kernels import decode_attention, prefill_attention
    from engine.kernels.decode_attention import MAX_SPLITS, combine_tiles


@pytest.mark.parametrize("group,head_dim", [(4, 128), (1, 64), (8, 256), (3, 128)])
def test_decode_variants_cover_every_split_count(group: int, head_dim: int) -> None:
    reps = warmup.decode_split_variants(group, head_dim)
    covered = {(s == 1, combine_tiles(group, head_dim, s)) for s in reps}
    for s in range(1, MAX_SPLITS + 1):
        assert (s == 1, combine_tiles(group, head_dim, s)) in covered, s
    assert len(covered) == len(reps)  # one launch per variant, no more


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("max_query_len", [1, 40, 512, 8192])
def test_prefill_variants_cover_every_query_length(monkeypatch: pytest.MonkeyPatch,
                                                   head_dim: int, max_query_len: int) -> None:
    monkeypatch.setattr(prefill_attention, "interpret_mode", lambda: False)  # the GPU's tiles
    reps = warmup.prefill_query_variants(head_dim, max_query_len)
    tiles = {prefill_attention.choose_prefill_tiles(head_dim, m) for m in reps}
    assert max(reps) <= max_query_len and len(tiles) == len(reps)
    for m in range(1, min(max_query_len, 600) + 1):
        assert prefill_attention.choose_prefill_tiles(head_dim, m) in tiles, m


def test_warm_up_launches_each_variant_and_leaves_the_cache_alone() -> None:
    # 4-token blocks: the warm-up's long sequences span many table entries. (A 16-token run
    # doubled this test's ~70 s under the interpreter and checked nothing more.)
    cache = torch.randn(2, 6, 4, 2, 16)
    before = cache.clone()
    n = warmup.warm_up_attention(cache, 4, torch.float32, max_query_len=64)
    expected = (len(warmup.decode_split_variants(2, 16))
                + len(warmup.prefill_query_variants(16, 64)))
    assert n == expected
    assert torch.equal(cache, before)
    assert decode_attention.split_counters(cache.device, 1).eq(0).all()
