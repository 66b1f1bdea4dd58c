"""KV block handoff between workers and the prefix-cache tiers (DESIGN.md §3, §4).

- `wire`            binary format of one block (header + scales + raw bytes, CRC-32); no pickle.
- `lease`           LeaseTable: blocks a prefill worker holds for a decode worker.
- `grpc_transport`  KvTransfer servicer (server side) and `pull_blocks` / `release` (client).
- `block_source`    CacheBlockSource: the servicer's source over a KV cache tensor + leases.
- `connector`       scheduler-side / worker-side connector interfaces + GrpcPullConnector.
- `tiers`           CpuTier (LRU, pinned), RedisTier, TieredStore keyed by block hash.
"""
