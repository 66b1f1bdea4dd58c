"""KV block handoff between workers and the prefix-cache tiers (docs/architecture.md, "A request's way through the layers" and "Shared contracts").

- `wire`            binary format of one block (header + scales + raw bytes, CRC-32); no pickle.
- `protocol`        what both sides share: fragment sizes, blocks per prompt, `KvTransferError`.
- `servicer`        KvTransfer servicer (the prefill worker's side) over a `KvBlockSource`.
- `pull_client`     `pull_blocks` / `pull_all` (the stream) and `release` (client).
- `raw_pulls`       `pull_blocks_shm` / `pull_blocks_tcp` / `pull_blocks_ipc` (client).
- `shm`             shared-memory segments for same-host pulls (`PullBlocksShm`).
- `cuda_ipc`        a KV cache exported through CUDA IPC for same-GPU pulls (`PullBlocksIpc`).
- `tcp`             the prefill worker's KV data port: raw blocks to ticket holders
                    (`PullBlocksTcp`); after CUDA IPC, the decode worker's first way.
- `handle`          `KvHandle` (where a prompt's KV is leased) and `LoadResult`.
- `connector`       the worker-side connector interface + GrpcPullConnector (which way a load
                    takes); `pull_ways` the ways themselves, into a `KvBlockSink`.
- `tiers`           CpuTier (LRU, pinned), RedisTier, TieredStore keyed by block hash.
"""

# Pulled blocks are written into the decode worker's cache this many at a time. A GPU engine's
# write waits for the steps queued on its stream before it (a freed block may still be written
# by a step in flight, so the write must come after them): one wait per batch, not per block.
WRITE_BATCH_BLOCKS = 16

# Connections one pull over the data port (`tcp`) opens at once, a contiguous stripe of blocks
# each: one Python stream stops short of what a loopback or a fast NIC carries
# (docs/performance.md). Here, not in `tcp`, so that torch-free code (the CLI) can name them.
DEFAULT_TCP_STREAMS = 4
MAX_TCP_STREAMS = 8
