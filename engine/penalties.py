"""Repetition, presence and frequency penalties from a device-resident history.

Each penalized request holds a slot: a row of output-token counts ([S, V] float32) and a row
marking the prompt's tokens ([S, V] bool). A step brings every slot up to its request's output
list (one new token each, in one small copy for the whole batch), then penalizes all its rows
with a few batched kernels. Before, each penalized row built its token lists on the host and
copied them over every step: ~10 kernels and two blocking copies a row (+1.1 ms per step for
one penalized request among 255 on the H200, docs/performance.md).

Slots are released once their request has finished (checked at each step that penalizes), and
the buffers grow by doubling up to a capacity (the runner's max_num_seqs): S rows cost
S × V × 5 bytes (641 KB a request at V = 128,256), and the runner keeps the capacity's worth out
of the KV cache's budget (`PenaltyState.bytes_for`). With every slot taken, a request outside
the step being sampled (preempted, or not scheduled this step) gives its slot up; its counts are
rebuilt from its output list when it is sampled again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.devices import to_device
from engine.request import Request

_FIRST_SLOTS = 8
_BYTES_PER_ENTRY = 4 + 1  # a float32 count and a bool prompt mark per slot and token id


class PenaltyState:
    """The penalized requests' token history on one device, for one vocabulary size, in at most
    `capacity` slots (None: unbounded)."""

    def __init__(self, vocab: int, device: torch.device, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.vocab = vocab
        self.device = device
        self.capacity = capacity
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.prompt_seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.owners: list[Request | None] = []
        self._slots: dict[int, int] = {}      # id(request) -> slot
        self._counted: dict[int, int] = {}    # id(request) -> its outputs in `counts`

    @staticmethod
    def bytes_for(slots: int, vocab: int) -> int:
        """Device memory of `slots` slots over a vocabulary of `vocab` ids."""
        return slots * vocab * _BYTES_PER_ENTRY

    @property
    def num_active(self) -> int:
        return len(self._slots)

    @property
    def num_slots(self) -> int:
        return self.counts.shape[0]

    def apply(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Penalize the rows of `reqs` that ask for it (HF repetition penalty over prompt and
        output; OpenAI presence and frequency penalties over the output). logits: [N, V]
        float32, modified in place and returned."""
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.has_penalties]
        if not rows:
            return logits
        self._release_finished()
        if self.capacity is not None and len(rows) > self.capacity:
            raise ValueError(f"{len(rows)} penalized rows in one step, capacity {self.capacity}")
        batch = {id(reqs[i]) for i in rows}
        slots = [self._slot(reqs[i], batch) for i in rows]
        self._count_new_outputs([reqs[i] for i in rows], slots)
        params = [(reqs[i].sampling_params.repetition_penalty,
                   reqs[i].sampling_params.frequency_penalty,
                   reqs[i].sampling_params.presence_penalty) for i in rows]
        dev = logits.device
        row_idx = to_device(rows, torch.long, dev)
        slot_idx = to_device(slots, torch.long, dev)
        p = to_device([x for t in params for x in t], torch.float32, dev).view(len(rows), 3)
        rep, freq, pres = p[:, 0:1], p[:, 1:2], p[:, 2:3]
        sub = logits.index_select(0, row_idx)
        counts = self.counts.index_select(0, slot_idx)
        output_seen = counts > 0
        seen = self.prompt_seen.index_select(0, slot_idx) | output_seen
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * output_seen.to(sub.dtype)
        logits.index_copy_(0, row_idx, sub)
        return logits

    def _slot(self, req: Request, batch: set[int]) -> int:
        """`req`'s slot, taking a free one (or growing, or taking one whose owner is not in
        `batch`, the ids of this step's penalized requests) on its first step."""
        key = id(req)  # unique while the slot's owner list keeps `req` alive
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        try:
            slot = self.owners.index(None)
        except ValueError:
            slot = len(self.owners)
            if self.capacity is None or slot < self.capacity:
                self._grow(slot + 1)
            else:
                slot = next(i for i, o in enumerate(self.owners)
                            if o is not None and id(o) not in batch)
                self._release(slot)
        self.owners[slot] = req
        self._slots[key] = slot
        self._counted[key] = 0
        self.counts[slot].zero_()
        self.prompt_seen[slot].zero_()
        prompt = [t for t in req.prompt_token_ids if 0 <= t < self.vocab]
        if prompt:
            self.prompt_seen[slot].index_fill_(0, to_device(prompt, torch.long, self.device),
                                               True)
        return slot

    def _count_new_outputs(self, reqs: Sequence[Request], slots: Sequence[int]) -> None:
        """Add each request's outputs since the last step to its slot's counts."""
        upd_slots: list[int] = []
        upd_tokens: list[int] = []
        for req, slot in zip(reqs, slots, strict=True):
            key = id(req)
            done = self._counted[key]
            out = req.output_token_ids
            if len(out) > done:
                for t in out[done:]:
                    if 0 <= t < self.vocab:
                        upd_slots.append(slot)
                        upd_tokens.append(t)
                self._counted[key] = len(out)
        if upd_slots:
            index = (to_device(upd_slots, torch.long, self.device),
                     to_device(upd_tokens, torch.long, self.device))
            ones = torch.ones(len(upd_slots), dtype=torch.float32, device=self.device)
            self.counts.index_put_(index, ones, accumulate=True)

    def _release_finished(self) -> None:
        for slot, owner in enumerate(self.owners):
            if owner is not None and owner.is_finished:
                self._release(slot)

    def _release(self, slot: int) -> None:
        owner = self.owners[slot]
        assert owner is not None
        self.owners[slot] = None
        del self._slots[id(owner)]
        del self._counted[id(owner)]

    def _grow(self, needed: int) -> None:
        size = max(_FIRST_SLOTS, self.counts.shape[0])
        while size < needed:
            size *= 2
        if self.capacity is not None:
            size = min(size, self.capacity)
        if size > self.counts.shape[0]:
            old = self.counts.shape[0]
            counts = torch.zeros(size, self.vocab, dtype=torch.float32, device=self.device)
            seen = torch.zeros(size, self.vocab, dtype=torch.bool, device=self.device)
            counts[:old] = self.counts
            seen[:old] = self.prompt_seen
            self.counts, self.prompt_seen = counts, seen
        self.owners.extend([None] * (needed - len(self.owners)))


def penalties_reference(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """The semantics `PenaltyState.apply` must match, row by row from the host lists (the
    tests' reference): repetition penalty (HF semantics, over prompt + output) and presence /
    frequency penalties (OpenAI semantics, over output tokens). logits: [N, V], modified in
    place and returned."""
    vocab = logits.shape[1]
    for i, req in enumerate(reqs):
        sp = req.sampling_params
        if not sp.has_penalties:
            continue
        row = logits[i]
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=row.device)
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty,
                                    vals * sp.repetition_penalty)
        if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0:
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
            out = out[out < vocab]
            counts = torch.zeros(vocab, dtype=row.dtype, device=row.device)
            counts.index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)
    return logits
