"""A step's inputs on the device: the scheduled requests flattened into token ids, positions,
KV slots, attention metadata and the rows to sample (`StepInputs.prepare`, the only place that
does), and which LoRA adapter each row runs.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from engine.attention.forward_context import AttentionMetadata
from engine.cuda_graphs import CudaGraphRunner
from engine.host_staging import PinnedStaging
from engine.lora import LoRABatch, LoRAStack
from engine.scheduler import SchedulerOutput

# A verify graph is replayed only where the step's own rows fill this share of its padded rows;
# other verify steps run their rows alone (piecewise graphs or eager).
DEFAULT_VERIFY_GRAPH_MIN_FILL = 0.0


class StepInputs:
    """Lays out each step's inputs for one runner, and keeps what the next step may take from
    the last one: its sampled tokens, still on the device (async scheduling)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        # Host buffers reused across steps (pinned; None on a CPU: engine/host_staging.py).
        self.staging = PinnedStaging() if device.type == "cuda" else None
        # The last launched step's sampled tokens (on the device) and their row per request.
        self.last_tokens: torch.Tensor | None = None
        self.last_rows: dict[str, int] = {}

    def prepare(self, out: SchedulerOutput, max_model_len: int, uniform_q: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the scheduled requests into the step's tensors (the only place that does).

        uniform_q > 0 (a verify step for the graphs of `verify_graphs`; every request at its
        last known token): each request gets exactly `uniform_q` rows, its token and drafts
        first, then padding rows (token 0, no KV write: slot -1); its length counts them, so the
        real rows' causal window is unchanged and only padding rows see past it.

        Host data is laid out in two pinned buffers reused across steps (int64: ids |
        positions | slots | logit rows | in-flight gathers; int32: query_start_loc | seq_lens |
        block_tables; engine/host_staging.py) and moved with two async copies.
        Returns (input_ids [T], positions [T], metadata, logit row per sampling request [S] on
        the device: indexing the hidden states with a host list would copy it from pageable
        memory, which waits for the whole forward before the LM head can be launched)."""
        bs = self.block_size
        sched = out.scheduled
        num_seqs = len(sched)
        if uniform_q:
            num_tokens = num_seqs * uniform_q
            # Padding rows' positions reach up to `uniform_q - 1` past the real ones: their
            # (unwritten, never used) KV must stay inside the table.
            max_blocks = max(-(-(s.num_computed_tokens + uniform_q) // bs) for s in sched)
        else:
            num_tokens = out.num_batched_tokens or sum(s.num_new_tokens for s in sched)
            max_blocks = max(len(s.block_ids) for s in sched)
        # Inputs still in flight (async scheduling): (row in this step, row of the last step's
        # sampled tokens). At most one per request: its last sampled token.
        # (A request verifying drafts reaches past its known tokens by them, not by a token
        # in flight: it has none.)
        inflight = [(i, s) for i, s in enumerate(sched)
                    if s.num_computed_tokens + s.num_new_tokens > s.request.num_tokens
                    and not s.draft_token_ids]
        num_gather = len(inflight)
        # One logits row per sampling request; one per query row when it verifies drafts.
        num_sample = sum(1 + len(s.draft_token_ids) for s in sched if s.sample)
        num_int64 = 3 * num_tokens + num_sample + 2 * num_gather
        num_int32 = 2 * num_seqs + 1 + num_seqs * max_blocks
        if self.staging is not None:  # pinned, reused (engine/host_staging.py)
            big, small = self.staging.take(num_int64, num_int32)
        else:  # the CPU (`.to(device)` below returns these very tensors: fresh each step)
            pin = self.device.type == "cuda"  # (staging turned off: tools/probes/probe_ttft_host.py)
            big = torch.empty(num_int64, dtype=torch.int64, pin_memory=pin)
            small = torch.zeros(num_int32, dtype=torch.int32, pin_memory=pin)
        b64, b32 = big.numpy(), small.numpy()
        ids, pos = b64[:num_tokens], b64[num_tokens:2 * num_tokens]
        slots = b64[2 * num_tokens:3 * num_tokens]
        rows_at = 3 * num_tokens
        logit_rows = b64[rows_at:rows_at + num_sample]
        gather = b64[rows_at + num_sample:].reshape(2, num_gather)  # [dst rows; src rows]
        qsl, seq_lens = b32[:num_seqs + 1], b32[num_seqs + 1:2 * num_seqs + 1]
        tables = b32[2 * num_seqs + 1:].reshape(num_seqs, max_blocks)
        num_sampled = 0
        num_decodes = 0
        o = 0
        for i, s in enumerate(sched):
            start, n = s.num_computed_tokens, s.num_new_tokens
            end = start + n
            table = s.block_ids
            tables[i, :len(table)] = table
            known = s.request.num_tokens
            if n == 1:  # decode: scalar path, no per-row numpy temporaries
                ids[o] = s.request.all_token_ids[start] if start < known else 0
                pos[o] = start
                slots[o] = table[start // bs] * bs + start % bs
                if not uniform_q:
                    num_decodes += 1
            else:
                p = np.arange(start, end)
                ids[o:o + min(n, known - start)] = s.request.all_token_ids[start:end]
                if s.draft_token_ids:  # the last known token, then the drafts
                    ids[o + 1:o + n] = s.draft_token_ids
                pos[o:o + n] = p
                slots[o:o + n] = tables[i, p // bs].astype(np.int64) * bs + p % bs
            if s.sample and s.draft_token_ids:
                logit_rows[num_sampled:num_sampled + n] = np.arange(o, o + n)
                num_sampled += n
            elif s.sample:
                logit_rows[num_sampled] = o + n - 1
                num_sampled += 1
            if uniform_q:
                if n < uniform_q:
                    ids[o + n:o + uniform_q] = 0
                    pos[o + n:o + uniform_q] = np.minimum(np.arange(end, start + uniform_q),
                                                          max_model_len - 1)
                    slots[o + n:o + uniform_q] = -1
                end = start + uniform_q
                n = uniform_q
            o += n
            qsl[i + 1] = o
            seq_lens[i] = end
        qsl[0] = 0
        for j, (i, s) in enumerate(inflight):
            # The request's last real row in this step (padding rows follow it when uniform).
            gather[0, j] = int(qsl[i]) + s.num_new_tokens - 1
            gather[1, j] = self.last_sampled_row(s.request.request_id)
        dev = self.device
        big_d = big.to(dev, non_blocking=True)
        small_d = small.to(dev, non_blocking=True)
        if self.staging is not None:
            self.staging.copied()
        if num_gather:
            assert self.last_tokens is not None
            g = big_d[rows_at + num_sample:].view(2, num_gather)
            big_d[:num_tokens].index_copy_(0, g[0], self.last_tokens.index_select(0, g[1]))
        seq_lens_cpu = seq_lens.tolist()
        md = AttentionMetadata(
            query_start_loc=small_d[:num_seqs + 1], seq_lens=small_d[num_seqs + 1:2 * num_seqs + 1],
            block_tables=small_d[2 * num_seqs + 1:].view(num_seqs, max_blocks),
            slot_mapping=big_d[2 * num_tokens:3 * num_tokens], num_decodes=num_decodes,
            max_query_len=uniform_q or max(s.num_new_tokens for s in sched),
            max_seq_len=max(seq_lens_cpu),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens_cpu,
            uniform_query_len=uniform_q if uniform_q > 1 else 0)
        return (big_d[:num_tokens], big_d[num_tokens:2 * num_tokens], md,
                big_d[rows_at:rows_at + num_sample])

    def last_sampled_row(self, request_id: str) -> int:
        row = self.last_rows.get(request_id)
        if row is None:
            raise RuntimeError(f"request {request_id!r} has a token in flight that the last "
                               "launched step did not sample")
        return row


def uniform_verify_rows(out: SchedulerOutput, q: int, graphs: CudaGraphRunner | None,
                        max_model_len: int, min_fill: float = 0.0) -> int:
    """Rows per sequence when this step replays a verify graph (else 0): a step with drafts
    in which every request is at its last known token. q: the verify graphs' rows per sequence
    (0: none captured).

    The step must be one that can be laid out with `q` rows per sequence
    (`prepare(uniform_q=q)`): every request samples (its logits row is its last real one), the
    step fits a bucket of `graphs` (when captured), no padding row reaches past the context's
    end, and its own rows fill at least `min_fill` of the padded ones (the graph computes every
    padding row: a batch of 64 where one sequence drafts 4 would compute 320 rows for 68)."""
    if not q or not out.has_drafts or any(s.num_new_tokens != 1 + len(s.draft_token_ids)
                                           for s in out.scheduled):
        return 0
    if min_fill > 0 and (sum(s.num_new_tokens for s in out.scheduled)
                         < min_fill * q * len(out.scheduled)):
        return 0
    fits = ((graphs is None or graphs.can_run(len(out.scheduled)))
            and all(s.sample and s.num_computed_tokens + q <= max_model_len
                    for s in out.scheduled))
    return q if fits else 0


def lora_rows(lora: LoRAStack | None, out: SchedulerOutput, md: AttentionMetadata,
              device: torch.device) -> tuple[LoRAStack, LoRABatch] | None:
    """Each of the step's rows' LoRA adapter slot (None: no row runs an adapter)."""
    if lora is None or not any(s.request.lora_slot for s in out.scheduled):
        return None
    qsl = md.query_start_loc_cpu
    slots = np.zeros(qsl[-1], dtype=np.int64)
    for i, s in enumerate(out.scheduled):
        slots[qsl[i]:qsl[i + 1]] = s.request.lora_slot
    return lora, LoRABatch(torch.from_numpy(slots).to(device, non_blocking=True))


def verify_graph_min_fill() -> float:
    """The least share of a verify graph's rows a step's own rows must fill for the step to
    replay it (`uniform_verify_rows`; `SPLITSERVE_VERIFY_GRAPH_MIN_FILL`, 0-1); read when a
    runner is created."""
    raw = os.environ.get("SPLITSERVE_VERIFY_GRAPH_MIN_FILL", str(DEFAULT_VERIFY_GRAPH_MIN_FILL))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"SPLITSERVE_VERIFY_GRAPH_MIN_FILL must be a number in [0, 1], got {raw!r}")
    return value
