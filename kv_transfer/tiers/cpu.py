"""The CPU tier: an LRU of encoded blocks bounded by bytes, in pinned slots when CUDA is there."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch


class PinnedSlots:
    """Fixed-size host slots for the CPU tier's entries, carved from power-of-two slabs.

    torch's caching host allocator rounds every pinned allocation up to a power of two, so an
    8B model's encoded block (2 MiB + 108 bytes) took 4 MiB on its own (measured on the H200
    host: 100 entries, 400 MB of RSS). A slab of SLAB_BYTES (or the next power of two above one
    slot) holds as many slots as fit. A slot handed out by `take` comes back when the last
    reference to its view is gone (a weakref callback): a tier load may still be reading an
    entry the tier has evicted, and that memory must not be refilled under it.

    allocate: bytes -> a uint8 CPU tensor (default: pinned). Thread-safe.
    """

    SLAB_BYTES = 64 << 20

    def __init__(self, slot_bytes: int, max_slots: int,
                 allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        if slot_bytes <= 0 or max_slots < 0:
            raise ValueError("slot_bytes must be > 0 and max_slots >= 0")
        self.slot_bytes = slot_bytes
        self.max_slots = max_slots
        self._slab_bytes = max(self.SLAB_BYTES, 1 << (slot_bytes - 1).bit_length())
        self._per_slab = self._slab_bytes // slot_bytes
        self._allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8,
                                                            pin_memory=True))
        self._lock = threading.RLock()  # weakref callbacks may run while it is held
        self._slabs: list[torch.Tensor] = []
        self._free: list[tuple[int, int]] = []  # (slab, offset)
        # A live view's weak reference -> its (slab, offset); hashed while the view lives.
        self._out: dict[weakref.ref[torch.Tensor], tuple[int, int]] = {}

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return len(self._slabs) * self._slab_bytes

    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return len(self._out)

    def take(self) -> torch.Tensor | None:
        """A free slot (a uint8 view of slot_bytes), or None when max_slots are in use."""
        with self._lock:
            if not self._free:
                if len(self._slabs) * self._per_slab >= self.max_slots:
                    return None
                slab = len(self._slabs)
                self._slabs.append(self._allocate(self._slab_bytes))
                count = min(self._per_slab, self.max_slots - slab * self._per_slab)
                self._free.extend((slab, i * self.slot_bytes) for i in reversed(range(count)))
            slab, offset = self._free.pop()
            view = self._slabs[slab][offset:offset + self.slot_bytes]
            self._out[weakref.ref(view, self._on_dead)] = (slab, offset)
            return view

    def _on_dead(self, ref: weakref.ref[torch.Tensor]) -> None:
        with self._lock:
            self._free.append(self._out.pop(ref))


class CpuTier:
    """LRU of encoded blocks bounded by total bytes, in pinned memory when CUDA is available
    (so a later host->device copy can be asynchronous): fixed-size slots of `PinnedSlots`, so
    the pinned memory is the capacity, not twice it.

    Thread-safe: every method holds the tier's lock for its whole body. `get` mutates the LRU
    order; `put` may evict least recently used blocks.
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool | None = None,
                 allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        """allocate: the slots' slab allocator (default: pinned memory); given, it implies
        slotted entries even without CUDA (tests)."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._pin = (allocate is not None or
                     (torch.cuda.is_available() if pin_memory is None else pin_memory))
        self._allocate = allocate
        self._slots: PinnedSlots | None = None  # made at the first put (it sets the size)
        self._lock = threading.Lock()
        # hash -> encoded block (bytes, or a slot's uint8 tensor [n]); last = most recent.
        self._blocks: OrderedDict[bytes, bytes | torch.Tensor] = OrderedDict()
        self._used_bytes = 0
        self.stats: dict[str, int] = {"hits": 0, "misses": 0, "evictions": 0, "rejected": 0}

    @property
    def slots(self) -> PinnedSlots | None:
        return self._slots

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def get(self, block_hash: bytes) -> bytes | None:
        """The encoded block (a copy) and mark it most recently used; None on a miss."""
        found = self.get_prefix([block_hash])
        return found[0] if found else None

    def get_prefix(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Encoded blocks of the longest cached prefix of block_hashes (copies)."""
        return [_as_bytes(value) for value in self.get_prefix_entries(block_hashes)]

    def get_prefix_entries(self, block_hashes: Sequence[bytes]) -> list[bytes | torch.Tensor]:
        """`get_prefix` without copies: the stored values themselves (slot tensors when
        pinning). An entry is never written while anyone holds it (a `put` takes another slot,
        and an evicted entry's slot comes back only when its last holder lets go): hold the
        entry itself, not only views of it, for as long as they are read."""
        found: list[bytes | torch.Tensor] = []
        with self._lock:
            for block_hash in block_hashes:
                value = self._blocks.get(block_hash)
                if value is None:
                    self.stats["misses"] += 1
                    break
                self._blocks.move_to_end(block_hash)
                self.stats["hits"] += 1
                found.append(value)
        return found

    def put(self, block_hash: bytes, data: bytes) -> bool:
        """Insert (or refresh) a block, evicting LRU blocks to fit; False if it can never fit
        (or, pinning, every slot is held by readers of evicted entries)."""
        size = len(data)
        with self._lock:
            if size > self.capacity_bytes:
                self.stats["rejected"] += 1
                return False
            # No local name keeps a dropped entry alive: its slot must be free for _store.
            if block_hash in self._blocks:
                self._drop(self._blocks.pop(block_hash))
            while self._used_bytes + size > self.capacity_bytes:
                self._drop(self._blocks.popitem(last=False)[1])
                self.stats["evictions"] += 1
            value = self._store(data)
            if value is None:
                self.stats["rejected"] += 1
                return False
            self._blocks[block_hash] = value
            self._used_bytes += size
        return True

    def _drop(self, value: bytes | torch.Tensor) -> None:
        # A slot's view goes with the last reference to it: this one, or a reader's.
        self._used_bytes -= _nbytes(value)

    def _store(self, data: bytes) -> bytes | torch.Tensor | None:
        if not self._pin:
            return bytes(data)
        if self._slots is None:
            self._slots = PinnedSlots(len(data), self.capacity_bytes // len(data),
                                      self._allocate)
        if len(data) != self._slots.slot_bytes:  # one spec per tier: not expected
            return bytes(data)
        slot = self._slots.take()
        if slot is not None:
            slot.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        return slot


def _as_bytes(value: bytes | torch.Tensor) -> bytes:
    return value if isinstance(value, bytes) else value.numpy().tobytes()


def _nbytes(value: bytes | torch.Tensor) -> int:
    return len(value) if isinstance(value, bytes) else value.numel()
