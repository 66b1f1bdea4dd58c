"""Which CUDA graphs a model runner captures, and capturing them: the piecewise graphs of short
mixed steps, the verify graphs of speculative decoding, the decode graphs with LoRA deltas and
the plain decode graphs, all in one pool, on one side stream, the decode graphs last.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.backend import PagedAttentionBackend
from engine.config import EngineConfig
from engine.cuda_graphs import CudaGraphRunner, GraphHost
from engine.piecewise_graphs import MIN_PIECEWISE_BUCKET, PiecewiseGraphRunner

logger = logging.getLogger(__name__)

# Largest verify step (sequences) captured in a CUDA graph. Each of its rows is a logits row:
# 64 x (1 + 4 drafts) x a 128k vocabulary is 82 MB of bf16 logits buffer.
SPEC_GRAPH_MAX_BATCH = 64


def captures_cuda_graphs(device: torch.device, enforce_eager: bool,
                         backend: PagedAttentionBackend) -> bool:
    """Whether decode steps are captured in CUDA graphs: on CUDA unless `enforce_eager`, and
    only through a backend that can be captured (the torch backend reads device values back
    to the host, which a capture forbids: that engine runs eagerly, with a warning)."""
    if device.type != "cuda" or enforce_eager:
        return False
    if not backend.captures_cuda_graphs:
        logger.warning("the %s attention backend cannot be captured in CUDA graphs; running "
                       "every step eagerly", backend.name)
        return False
    return True


@dataclass(slots=True)
class CapturedGraphs:
    """Every set of graphs `capture_graphs` captured (None: that set was not)."""

    stream: torch.cuda.Stream  # the side stream they were captured on
    decode: CudaGraphRunner
    # Decode steps with LoRA adapter rows (the graphs add their deltas).
    lora: CudaGraphRunner | None = None
    # Verify steps of speculative decoding, `verify_q_len` rows per sequence.
    verify: CudaGraphRunner | None = None
    verify_q_len: int = 0
    # Other steps of up to `piecewise_graph_max_tokens` tokens: layers from graphs, attention
    # eager (engine/piecewise_graphs.py).
    piecewise: PiecewiseGraphRunner | None = None


def capture_graphs(host: GraphHost, config: EngineConfig, speculative: bool) -> CapturedGraphs:
    """Capture every set of CUDA graphs of `host` (a model runner), all in one pool, on one
    side stream, the decode graphs last. Last because a kernel launched on a stream other than
    the one they replay on, once they are captured, measured +0.13-0.15 ms on every later
    decode step at batch 8 and 64 on the H200 (not at batch 1), for the rest of the process;
    captured after the other sets they keep their speed (tools/probes/probe_stream_cost.py,
    docs/performance.md "One stream after the decode graphs").
    speculative: requests may speculate, so verify steps get graphs of their own."""
    stream = torch.cuda.Stream(host.device)
    max_decode_batch = min(config.runner.cuda_graph_max_batch, config.scheduler.max_num_seqs)
    pool = None
    piecewise: PiecewiseGraphRunner | None = None
    n = min(config.runner.piecewise_graph_max_tokens, config.scheduler.max_num_batched_tokens)
    if n >= MIN_PIECEWISE_BUCKET:
        piecewise = PiecewiseGraphRunner(host, n, pool=pool)
        piecewise.capture(stream)
        pool = piecewise.pool
    verify: CudaGraphRunner | None = None
    verify_q_len = 0
    if speculative:
        # Speculation is for light load (the gateway turns it off above a few requests per
        # worker): verify graphs up to SPEC_GRAPH_MAX_BATCH sequences; bigger verify steps
        # run eagerly.
        verify_q_len = 1 + config.speculative.num_speculative_tokens
        verify = CudaGraphRunner(host, verify_q_len, min(SPEC_GRAPH_MAX_BATCH, max_decode_batch),
                                 pool=pool, with_lora=host.lora is not None)
        verify.capture(stream)
        pool = verify.pool
    lora: CudaGraphRunner | None = None
    if host.lora is not None:
        # Decode steps with adapter rows replay graphs that add their deltas; steps of the
        # base model alone keep graphs without them (the deltas' kernels cost ~1.6 ms per
        # step of an 8B model on the H200 even when every row's delta is zero).
        lora = CudaGraphRunner(host, max_batch=max_decode_batch, pool=pool, with_lora=True)
        lora.capture(stream)
        pool = lora.pool
    decode = CudaGraphRunner(host, max_batch=max_decode_batch, pool=pool)
    decode.capture(stream)
    return CapturedGraphs(stream, decode, lora, verify, verify_q_len, piecewise)
