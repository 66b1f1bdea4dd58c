"""Two micro-batches of one decode step on two CUDA streams, so that one half's attention
(bound by KV-cache reads) runs beside the other half's MLP (bound by matmul compute).

A large decode step spends most of its time in decode attention at the copy ceiling and in
compute-bound matmuls, one after the other (docs/performance.md). Split the batch in two halves
A and B, and per layer run

    stream 0:  A.attn(l)  A.mlp(l)  [wait B.attn(l)]  A.attn(l+1) ...
    stream 1:  [wait A.attn(l)]  B.attn(l)  B.mlp(l)  [wait A.attn(l+1)]  B.attn(l+1) ...

so the attention parts (norm, QKV, RoPE + KV write, attention, O projection) of the two halves
never run together, and each runs beside the other half's MLP. On a device without streams
(the CPU) the same calls run one after the other: the split is then exact but saves nothing,
which is what lets the CPU tests check it.

Off by default (`decode_overlap_min_batch = 0`): on an H200 with dummy Llama-3.1-8B, random
1000x1000 ran at 7,872 output tok/s with it (halves from 128 sequences up) against 9,736 without
(bench/results/h200/ab_overlap_{on,off}_a35c1cd.json); probably (not profiled) the halves'
kernels contend for the SMs instead of filling each other's idle units, and each half streams
the weights again. It stays as the seam for an overlap that partitions the SMs between the two
streams.

Tensors made on one stream and read on the other are marked with `record_stream`, so the
caching allocator does not hand their memory out again while the other stream may still read
it (during CUDA-graph capture such blocks stay reserved until the capture ends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


class Lanes:
    """The two halves' streams inside one overlapped forward pass (None on the CPU)."""

    def __init__(self, main: torch.cuda.Stream | None, side: torch.cuda.Stream | None) -> None:
        self._streams = (main, side)
        self._attention_done: list[torch.cuda.Event | None] = [None, None]

    @contextlib.contextmanager
    def lane(self, i: int) -> Iterator[None]:
        """Enqueue what follows on half `i`'s stream."""
        stream = self._streams[i]
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def wait_other_attention(self, i: int) -> None:
        """Half `i`'s attention starts after the other half's latest one has finished."""
        event = self._attention_done[1 - i]
        stream = self._streams[i]
        if event is not None and stream is not None:
            stream.wait_event(event)

    def attention_done(self, i: int) -> None:
        stream = self._streams[i]
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._attention_done[i] = event

    def hand_back(self, tensors: Iterable[torch.Tensor]) -> None:
        """`tensors` were made on the side stream and are read on the main one from now on."""
        main = self._streams[0]
        if main is not None:
            for t in tensors:
                t.record_stream(main)


class MicroBatchStreams:
    """The side stream of overlapped decode steps, made once per runner."""

    def __init__(self, device: torch.device) -> None:
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def overlap(self, shared: Iterable[torch.Tensor]) -> Iterator[Lanes]:
        """Fork the side stream off the current one (which then is half A's), and join it back
        at the end. `shared`: tensors made before the fork that half B reads."""
        if self._side is None:
            yield Lanes(None, None)
            return
        main, side = torch.cuda.current_stream(), self._side
        side.wait_stream(main)
        for t in shared:
            t.record_stream(side)
        try:
            yield Lanes(main, side)
        finally:
            main.wait_stream(side)
