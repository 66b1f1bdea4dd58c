"""The per-step forward context: set once around a forward pass, read only by attention.

Non-nestable by design: a forward pass sees exactly one batch's metadata. The context is per
thread: every engine runs its steps on its own thread, and several engines may share a process
(tests, the colocated CLI), so one engine's forward pass must never see another's batch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.attention.prefill_run import PrefillRun
    from engine.lora import LoRABatch, LoRAStack


@dataclass(slots=True)
class AttentionMetadata:
    """Flattened varlen batch; sequences ordered decodes first. Shapes use B sequences, T tokens."""

    query_start_loc: torch.Tensor   # [B+1] int32, token offsets of each sequence
    seq_lens: torch.Tensor          # [B] int32, KV length including this step's tokens
    block_tables: torch.Tensor      # [B, max_blocks] int32
    slot_mapping: torch.Tensor      # [T] int64, block_id * block_size + offset
    num_decodes: int                # leading sequences with exactly one new token
    max_query_len: int
    max_seq_len: int
    # Host copies for the reference backend's python loops (avoid device syncs there).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # A backend's plan for the prefill sequences (which kernel each attends with), made at the
    # first layer and reused by the others: once per step, not once per layer.
    prefill_plan: tuple[PrefillRun, ...] | None = None
    # > 1: a speculative verify step laid out with exactly this many query tokens per sequence
    # (no decodes; `ModelRunner.prepare(uniform_q=...)`), which the decode kernel can take whole.
    uniform_query_len: int = 0


def split_decode_metadata(md: AttentionMetadata, split: int
                          ) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A pure-decode batch's metadata as two batches, sequences [0, split) and [split, B):
    views of `md`'s tensors (one new tensor: the second half's query offsets)."""
    num_seqs = md.seq_lens.shape[0]
    if md.num_decodes != num_seqs or md.slot_mapping.shape[0] != num_seqs:
        raise ValueError("only a batch of single-token decodes can be split")
    if not 0 < split < num_seqs:
        raise ValueError(f"split must be in (0, {num_seqs}), got {split}")

    def part(lo: int, hi: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=md.query_start_loc[lo:hi + 1] - lo if lo else md.query_start_loc[:hi + 1],
            seq_lens=md.seq_lens[lo:hi], block_tables=md.block_tables[lo:hi],
            slot_mapping=md.slot_mapping[lo:hi], num_decodes=hi - lo, max_query_len=1,
            max_seq_len=md.max_seq_len,
            query_start_loc_cpu=[x - lo for x in md.query_start_loc_cpu[lo:hi + 1]],
            seq_lens_cpu=md.seq_lens_cpu[lo:hi])

    return part(0, split), part(split, num_seqs)


@dataclass(frozen=True, slots=True)
class RopeInputs:
    """What a backend that fuses RoPE into its KV write (`fuses_rope`) needs to rotate q and k:
    the model passes this instead of rotating them itself."""

    positions: torch.Tensor         # [T] int32/int64, each token's position
    cos_sin_cache: torch.Tensor     # [max_pos, D] float32: cos in [0, D/2), sin in [D/2, D)
    is_neox: bool                   # pairs (x[i], x[i + D/2]); False: (x[2i], x[2i+1])


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]   # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    # Per layer (k_scale, v_scale) of an fp8 or int8 cache; None: unquantized (scale 1.0).
    # Python floats: constant for an engine's life, so CUDA graphs bake them in.
    kv_scales: list[tuple[float, float]] | None = None
    # The step's LoRA adapters and the rows that run each (None: every row runs the base model).
    lora: tuple[LoRAStack, LoRABatch] | None = None

    def kv_scale(self, layer: int) -> tuple[float, float]:
        return layer_kv_scale(self.kv_scales, layer)


def layer_kv_scale(kv_scales: list[tuple[float, float]] | None, layer: int
                   ) -> tuple[float, float]:
    """Layer `layer`'s (k_scale, v_scale); (1.0, 1.0) for an unquantized cache."""
    return kv_scales[layer] if kv_scales is not None else (1.0, 1.0)


class _Local(threading.local):
    current: ForwardContext | None = None


_local = _Local()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    if _local.current is not None:
        raise RuntimeError("forward contexts do not nest")
    _local.current = ctx
    try:
        yield
    finally:
        _local.current = None


def get_forward_context() -> ForwardContext:
    ctx = _local.current
    if ctx is None:
        raise RuntimeError("attention called outside a forward context")
    return ctx


def current_lora() -> tuple[LoRAStack, LoRABatch] | None:
    """The running step's adapters (None outside a forward context or without any)."""
    ctx = _local.current
    return None if ctx is None else ctx.lora
