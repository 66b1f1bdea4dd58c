"""CUDA graphs for pure-decode steps, captured per padded batch-size bucket.

Buckets 1, 2, 4, 8, then every 8 up to the max decode batch, share one memory pool. A step with
n decodes replays the smallest bucket >= n: inputs are copied into static buffers (padding rows
write no KV: slot -1) and the graph runs the model *and* the LM head, so a greedy decode step is
one replay plus one argmax. Buckets from `decode_overlap_min_batch` up are captured as two
micro-batches on two streams (engine/model/overlap.py). Steps with prompt tokens go to the
piecewise graphs (engine/piecewise_graphs.py) when they fit, else eagerly. The decode graphs are
captured after every other set (`engine.runner.graph_capture.capture_graphs` says why).

Speculative decoding's verify steps get a second set (`q_len` = 1 + the engine's drafts per
step): every sequence owns `q_len` query rows, its last known token, its drafts, then padding
rows that write no KV (`StepInputs.prepare(out, uniform_q=...)` lays a step out so). Their
attention is the split decode kernel with `q_len` query rows per sequence, causal among them,
which reads lengths and block tables from the device, so the same graph serves any context.
(A third set, for steps of short prompts laid out the same way, was superseded by the piecewise
graphs, 5.3 against 6.2 ms for a 16-token prompt's first token on the H200, and removed.)
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Protocol

import torch

from engine.attention.forward_context import AttentionMetadata, ForwardContext, forward_context
from engine.config import EngineConfig, ModelConfig
from engine.lora import LoRABatch, LoRAStack
from engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Eager runs of a bucket before it is captured: one compiles its Triton kernels and loads every
# module it launches (nothing here autotunes); a second one only cost start-up time.
WARMUP_RUNS = 1


class GraphHost(Protocol):
    """What graphs read from the model runner they are captured for (`ModelRunner` is one):
    a protocol, so that the graphs need not import the runner that captures them."""

    config: EngineConfig
    model_config: ModelConfig  # the whole model's
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    model: LlamaForCausalLM
    lora: LoRAStack | None
    num_overlapped_steps: int  # counted by replays of overlapped buckets too

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The KV cache per layer."""
        ...

    @property
    def kv_scale_values(self) -> list[tuple[float, float]] | None:
        """Per layer (k_scale, v_scale) of a quantized cache; None: unquantized."""
        ...

    def overlaps(self, num_decodes: int) -> bool:
        """Whether a pure-decode batch this large runs as two overlapped micro-batches."""
        ...

    def forward_overlapped(self, input_ids: torch.Tensor, positions: torch.Tensor,
                           md: AttentionMetadata) -> torch.Tensor:
        """The model over a pure-decode batch as two micro-batches."""
        ...


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphRunner:
    def __init__(self, runner: GraphHost, q_len: int = 1, max_batch: int | None = None,
                 pool: Any = None, with_lora: bool = False) -> None:
        """q_len: query rows per sequence (1: decode; 1 + drafts: speculative verification).
        pool: another runner's graph pool to share (steps never run two graphs at once).
        with_lora: the graphs add each row's LoRA adapter delta (the runner's adapters)."""
        self.runner = runner
        self.q_len = q_len
        cfg = runner.config
        if max_batch is None:
            max_batch = min(cfg.runner.cuda_graph_max_batch, cfg.scheduler.max_num_seqs)
        self.buckets = bucket_sizes(max_batch)
        dev = runner.device
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        n = self.buckets[-1]
        rows = n * q_len
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.full((n,), q_len, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(0, rows + 1, q_len, dtype=torch.int32, device=dev)
        # With LoRA adapters loaded, each row's adapter slot (0: the base model): the graphs
        # add every row's own adapter's delta (engine/lora/stack.py), whatever the mix.
        self.token_slots = (torch.zeros(rows, dtype=torch.long, device=dev)
                            if with_lora and runner.lora is not None else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # One logits buffer shared by every bucket (a per-bucket output would cost
        # vocab x sum(buckets) floats: gigabytes for a 128k vocabulary).
        self.logits_buf = torch.empty((rows, runner.model_config.vocab_size), dtype=runner.dtype,
                                      device=dev)
        self.pool: Any = pool
        self.num_replays = 0

    def _metadata(self, b: int) -> AttentionMetadata:
        q = self.q_len
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b * q],
            # Verify rows are prefill rows to the backend: causal over their own sequence.
            num_decodes=b if q == 1 else 0, max_query_len=q,
            max_seq_len=self.runner.max_model_len,
            query_start_loc_cpu=list(range(0, (b + 1) * q, q)), seq_lens_cpu=[q] * b,
            uniform_query_len=q if q > 1 else 0)

    def _forward(self, b: int) -> None:
        r = self.runner
        md = self._metadata(b)
        rows = b * self.q_len
        lora = (None if self.token_slots is None or r.lora is None
                else (r.lora, LoRABatch(self.token_slots[:rows])))
        with forward_context(ForwardContext(md, r.kv_caches, r.kv_scale_values, lora)):
            if self.q_len == 1 and r.overlaps(b):  # both streams: the replay overlaps the halves
                hidden = r.forward_overlapped(self.input_ids[:b], self.positions[:b], md)
            else:
                hidden = r.model(self.input_ids[:rows], self.positions[:rows])
        torch.mm(hidden, r.model.lm_head_weight.t(), out=self.logits_buf[:rows])

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream) -> None:
        """Capture every bucket on `stream` (a side stream; the runner's one for all captures)."""
        # This process's allocator, not the device's free memory: another process on the same
        # device (a prefill worker beside a decode worker) allocates while this one captures.
        reserved_before = torch.cuda.memory_reserved()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first: later ones reuse its pool
                for _ in range(WARMUP_RUNS):  # kernel compilation and module loads off the graph
                    self._forward(b)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    self._forward(b)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved() - reserved_before
        logger.info("captured %d CUDA graphs (batch 1..%d, %d rows per sequence%s) using "
                    "%.2f GiB", len(self.graphs), self.buckets[-1], self.q_len,
                    ", LoRA" if self.token_slots is not None else "", used / 2**30)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
            token_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Replay for `n` sequences (`n * q_len` rows, laid out as `_metadata` says); returns
        their logits [n * q_len, vocab] in the model dtype: a view of the shared buffer, valid
        until the next replay (the sampler reads it in stream order). `token_slots`: the rows'
        LoRA adapters (None: every row the base model).
        Not widened to float32 here: greedy rows take their argmax on it as it is (the sampler
        widens only for rows that need more), which saved a copy of the whole [n, vocab] block
        per step (0.3 ms at 768 rows on the H200, probe_tput_fp8_768g_d18ba9a.json)."""
        q = self.q_len
        rows = input_ids.shape[0]
        n = rows // q
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        w = md.block_tables.shape[1]
        self.block_tables[:n, :w].copy_(md.block_tables, non_blocking=True)
        if self.token_slots is not None:
            if token_slots is None:
                self.token_slots.zero_()
            else:
                self.token_slots[:rows].copy_(token_slots, non_blocking=True)
                self.token_slots[rows:].zero_()
        if b > n:  # padding sequences: write no KV, attend over their own (garbage) rows
            self.slot_mapping[rows:b * q].fill_(-1)
            self.seq_lens[n:b].fill_(q)
            self.input_ids[rows:b * q].zero_()
            self.positions[rows:b * q].zero_()
        self.graphs[b].replay()
        self.num_replays += 1
        if self.runner.overlaps(b):
            self.runner.num_overlapped_steps += 1
        return self.logits_buf[:rows]
