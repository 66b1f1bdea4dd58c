"""KV handoff within one host's GPUs: a worker's KV cache exported through CUDA IPC, mapped by
another process.

Two workers on one GPU (a prefill and a decode worker beside each other), or on two peer GPUs
of one host (NVLink or PCIe P2P), need not move KV through the host at all; the importer maps
the cache on the exporter's GPU (found by UUID: indices differ between processes) and copies
from it across peer access. The exporting side describes its whole cache tensor with torch's CUDA
IPC (`UntypedStorage._share_cuda_`, what `torch.multiprocessing` sends between processes); the
importer maps that allocation once (`_new_shared_cuda`) and copies leased blocks out of it on
the device. The description travels as plain fields in a protobuf message (`CudaIpcCache`),
never pickled.

Reference counting follows `torch.multiprocessing.reductions.rebuild_cuda_tensor`: every
export carries a fresh slot in the exporter's reference counter, and an importer that already
mapped the allocation gives that slot back at once (`_release_ipc_counter`), so the exporter's
allocation is kept alive exactly while some importer maps it.

Trust: a mapped cache is readable and writable by the importer. Only processes of the same
host and user reach it (CUDA IPC handles are local), and only callers holding the cluster's
credential get one (the KvTransfer service is authenticated like every internal service).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.devices import indexed_device


class IpcUnavailable(Exception):
    """CUDA IPC cannot serve this pull (no CUDA, another GPU, a handle that will not open)."""


@dataclass(frozen=True, slots=True)
class CacheExport:
    """One export of a KV cache tensor: the fields of `splitserve.v1.CudaIpcCache`."""

    mem_handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    num_blocks: int


def device_uuid(device: torch.device) -> bytes:
    """The GPU's 16-byte UUID (the same physical GPU has the same one in every process, whatever
    its index under CUDA_VISIBLE_DEVICES); b"" for a non-CUDA device."""
    if device.type != "cuda":
        return b""
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = torch.cuda.get_device_properties(index).uuid
    except (RuntimeError, AssertionError):  # a build or a machine without CUDA
        return b""
    raw = getattr(uuid, "bytes", None)
    if raw is None:  # printed as "GPU-xxxxxxxx-xxxx-..." or as a plain UUID
        raw = bytes.fromhex(str(uuid).removeprefix("GPU-").replace("-", ""))
    return bytes(raw)


def local_device(uuid: bytes) -> torch.device | None:
    """This process's device of the GPU with `uuid` (another process's, found by UUID since
    CUDA_VISIBLE_DEVICES numbers GPUs per process), or None if it is not visible here."""
    if len(uuid) != 16 or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        if device_uuid(device) == uuid:
            return device
    return None


def reachable(src: torch.device, dst: torch.device) -> bool:
    """Whether `dst` can copy from memory on `src` directly: the same GPU, or a peer."""
    src, dst = indexed_device(src), indexed_device(dst)
    if src == dst:
        return True
    assert src.index is not None and dst.index is not None
    return bool(torch.cuda.can_device_access_peer(dst.index, src.index))


def export_cache(cache: torch.Tensor) -> CacheExport:
    """Describe `cache` ([L, 2, num_blocks, ...], contiguous, on a GPU) for another process."""
    if cache.device.type != "cuda":
        raise IpcUnavailable(f"the KV cache is on {cache.device}, not a GPU")
    if not cache.is_contiguous():
        raise IpcUnavailable("the KV cache is not contiguous")
    (_device, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle,
     event_sync) = cache.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
    return CacheExport(bytes(handle), int(storage_bytes), int(storage_offset), bytes(ref_handle),
                       int(ref_offset), bytes(event_handle or b""), bool(event_sync),
                       int(cache.storage_offset()), int(cache.shape[2]))


class CacheImporter:
    """Maps exported caches into this process, one per exporting worker, and views them as
    tensors. A worker that restarted exports a new allocation: its old mapping is dropped then,
    so this process does not keep a dead worker's cache alive on the GPU.

    Thread-safe (pulls run on the event loop, copies in threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # exporter (its address) → ((IPC handle, offset), the mapped storage)
        self._mapped: dict[str, tuple[tuple[bytes, int], torch.UntypedStorage]] = {}

    def open(self, export: CacheExport, device: torch.device, dtype: torch.dtype,
             block_shape: tuple[int, ...], source: str = "") -> torch.Tensor:
        """The exported cache as [L, 2, num_blocks, *block_shape[2:]] of `dtype` on `device`
        (this process's index of the exporter's GPU). block_shape: [L, 2, block_size, Hkv, D];
        source: who exported it (a worker address). Raises IpcUnavailable when the handle does
        not open here, ValueError when the export does not describe a cache of this shape."""
        num_layers, two, *rest = block_shape
        shape = (num_layers, two, export.num_blocks, *rest)
        numel = 1
        for n in shape:
            numel *= n
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if export.num_blocks < 1 or (export.tensor_offset + numel) * itemsize > export.storage_bytes:
            raise ValueError(f"a cache of {export.num_blocks} blocks of {block_shape} {dtype} "
                             f"does not fit the exported {export.storage_bytes} bytes")
        if device.type != "cuda":
            raise IpcUnavailable(f"{device} is not a GPU")
        index = device.index if device.index is not None else torch.cuda.current_device()
        storage = self.storage_for(source, export, index)
        flat = torch.empty(0, dtype=dtype, device=torch.device("cuda", index)).set_(
            storage, export.tensor_offset, (numel,), (1,))
        return flat.view(shape)

    def storage_for(self, source: str, export: CacheExport, index: int) -> torch.UntypedStorage:
        """The mapped storage of `source`'s export: mapped now if it is new, the earlier mapping
        if not (whose export's reference slot then goes straight back, as torch does), a new one
        replacing it if `source` now exports another allocation."""
        key = (export.mem_handle, export.storage_offset_bytes)
        with self._lock:
            held = self._mapped.get(source)
            if held is not None and held[0] == key:
                torch.UntypedStorage._release_ipc_counter(  # type: ignore[attr-defined]
                    export.ref_counter_handle, export.ref_counter_offset,
                    device=torch.device("cuda", index))
                return held[1]
            if held is not None:  # the exporter restarted: unmap its old cache
                del self._mapped[source]
            try:
                torch.cuda._lazy_init()
                storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                    index, export.mem_handle, export.storage_bytes,
                    export.storage_offset_bytes, export.ref_counter_handle,
                    export.ref_counter_offset, export.event_handle or None,
                    export.event_sync_required)
            except RuntimeError as exc:  # another host/namespace, or IPC not permitted
                raise IpcUnavailable(f"cannot map the exported KV cache: {exc}") from exc
            self._mapped[source] = (key, storage)
            return storage
