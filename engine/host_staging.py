"""Pinned host buffers that a step's inputs are laid out in, reused from step to step.

`ModelRunner.prepare` writes each step's ids, positions, slots and block tables into one int64
and one int32 host buffer and moves them with two asynchronous copies, which needs pinned
memory. Allocating it per step went through the caching host allocator, and on the H200 that
call took 1.7-3.9 ms of the host's time before a 4096-token prompt's first kernel in two of
three traced runs (bench/results/h200/ttft_host/ttft_host_26ad1a2.json: `torch.empty` own
time in the window before the first device operation), time the device spent idle. vLLM keeps
persistent pinned input buffers for the same reason.

A buffer may be rewritten only once the device has read it: each use records an event after
its copies, and the buffer is handed out again (slots used round-robin) only after that event.
With async scheduling the step two back has finished before a step is prepared, so two slots
never wait in practice; the wait is what makes a third step in flight safe as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _capacity(n: int) -> int:
    """Grow to the next power of two (at least 4 Ki elements): few regrowths, bounded waste."""
    return max(4096, 1 << max(0, n - 1).bit_length())


@dataclass(slots=True)
class _Slot:
    big: torch.Tensor | None = None      # int64, pinned
    small: torch.Tensor | None = None    # int32, pinned
    copied: torch.cuda.Event | None = field(default=None)  # the device has read this slot


class PinnedStaging:
    """Round-robin pinned (int64, int32) buffer pairs for a CUDA device's step inputs."""

    def __init__(self, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self._taken: _Slot | None = None
        self.num_waits = 0  # times a slot's previous copies were still queued (tests, probes)

    def take(self, num_int64: int, num_int32: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next slot's buffers cut to these lengths; the int32 part zeroed (block tables'
        padding). Valid until `copied` is called and the slot comes round again."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.copied is not None:
            if not slot.copied.query():
                self.num_waits += 1
                slot.copied.synchronize()
            slot.copied = None
        if slot.big is None or slot.big.numel() < num_int64:
            slot.big = torch.empty(_capacity(num_int64), dtype=torch.int64, pin_memory=True)
        if slot.small is None or slot.small.numel() < num_int32:
            slot.small = torch.empty(_capacity(num_int32), dtype=torch.int32, pin_memory=True)
        self._taken = slot
        small = slot.small[:num_int32]
        small.zero_()
        return slot.big[:num_int64], small

    def copied(self, stream: torch.cuda.Stream | None = None) -> None:
        """The copies from the slot last taken are queued on `stream` (default: the current
        one): the slot is reused only after they ran."""
        if self._taken is None:
            raise RuntimeError("copied() without a slot taken")
        event = torch.cuda.Event()
        event.record(stream)
        self._taken.copied = event
        self._taken = None
