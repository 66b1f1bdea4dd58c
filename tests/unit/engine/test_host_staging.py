"""The runner's reused pinned input buffers (engine/host_staging.py): a buffer is not handed out
again while the device has yet to read it. CUDA only (pinned memory and events); run on the
GPU machine: `pytest tests/unit/engine/test_host_staging.py`."""

from __future__ import annotations

import pytest
import torch

from engine.host_staging import PinnedStaging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _busy_device(ms: float = 200.0) -> None:
    """Queue ~`ms` of device work ahead of what comes next on the stream."""
    torch.cuda._sleep(int(ms * 1e6))  # cycles at ~1-2 GHz: 100-200 ms


def test_slot_reused_only_after_its_copy_ran() -> None:
    staging = PinnedStaging(slots=2)
    big, small = staging.take(10, 5)
    assert big.is_pinned() and small.is_pinned()
    assert small.tolist() == [0] * 5
    _busy_device()
    big.copy_(torch.arange(10))
    dst = big.to("cuda", non_blocking=True)  # queued behind the sleep
    staging.copied()
    staging.take(10, 5)  # the other slot: no wait
    staging.copied()
    assert staging.num_waits == 0
    again, _ = staging.take(10, 5)  # the first slot again: must wait for its copy
    assert again.data_ptr() == big.data_ptr()
    assert staging.num_waits == 1
    again.fill_(-1)  # what a next step would write
    assert dst.tolist() == list(range(10))  # the device got what was there before


def test_buffers_grow_and_are_zeroed() -> None:
    staging = PinnedStaging(slots=1)
    _, small = staging.take(4, 8)
    small.fill_(7)
    staging.copied()
    big, small = staging.take(100_000, 8)
    assert big.numel() == 100_000 and small.tolist() == [0] * 8
    staging.copied()
    with pytest.raises(RuntimeError):
        staging.copied()
    with pytest.raises(ValueError):
        PinnedStaging(slots=0)
