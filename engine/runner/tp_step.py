"""A forward pass's inputs as two flat tensors, for rank 0 to broadcast and a worker to unpack.

int64: input ids | positions | slot mapping [| LoRA slots] ([3T] or [4T]); int32: query offsets
| sequence lengths | block tables ([2B + 1 + B × max_blocks]). The scalars ride in the
command's header.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.attention.forward_context import AttentionMetadata
from engine.parallel.protocol import Cache, ForwardHeader


def step_header(ids: torch.Tensor, md: AttentionMetadata, cache: Cache,
                scratch_blocks: int = 0, lora: bool = False) -> ForwardHeader:
    num_seqs = int(md.seq_lens.shape[0])
    return ForwardHeader(
        num_tokens=int(ids.shape[0]), num_seqs=num_seqs,
        max_blocks=int(md.block_tables.shape[1]) if num_seqs else 0,
        num_decodes=md.num_decodes, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
        uniform_query_len=md.uniform_query_len, cache=cache, scratch_blocks=scratch_blocks,
        lora=lora)


def broadcast_step(ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                   lora_slots: torch.Tensor | None = None) -> None:
    """Rank 0: send the step's tensors (after its header went down the pipes); `lora_slots`:
    each row's LoRA adapter slot, appended to the int64 tensor (the header says so)."""
    parts = [ids.long(), positions.long(), md.slot_mapping.long()]
    if lora_slots is not None:
        parts.append(lora_slots.long())
    big = torch.cat(parts)
    small = torch.cat([md.query_start_loc.int(), md.seq_lens.int(),
                       md.block_tables.int().reshape(-1)])
    dist.broadcast(big, src=0)
    dist.broadcast(small, src=0)


def receive_step(h: ForwardHeader, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
    """A worker: the step's (input ids, positions, metadata, LoRA slots or None) as rank 0
    broadcast them."""
    t, b = h.num_tokens, h.num_seqs
    big = torch.empty((4 if h.lora else 3) * t, dtype=torch.int64, device=device)
    small = torch.empty(2 * b + 1 + b * h.max_blocks, dtype=torch.int32, device=device)
    dist.broadcast(big, src=0)
    dist.broadcast(small, src=0)
    qsl, seq_lens = small[:b + 1], small[b + 1:2 * b + 1]
    md = AttentionMetadata(
        query_start_loc=qsl, seq_lens=seq_lens,
        block_tables=small[2 * b + 1:].view(b, h.max_blocks), slot_mapping=big[2 * t:3 * t],
        num_decodes=h.num_decodes, max_query_len=h.max_query_len, max_seq_len=h.max_seq_len,
        query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
        uniform_query_len=h.uniform_query_len)
    return big[:t], big[t:2 * t], md, big[3 * t:] if h.lora else None
