"""KV block handoff between workers and the prefix-cache tiers (DESIGN.md §3, §4).

- `wire`            binary format of one block (header + scales + raw bytes, CRC-32); no pickle.
- `grpc_transport`  KvTransfer servicer (server side) and `pull_blocks` / `release` (client).
- `connector`       scheduler-side / worker-side connector interfaces + GrpcPullConnector.
- `tiers`           CpuTier (LRU, pinned), RedisTier, TieredStore keyed by block hash.
"""
