"""Tensor parallelism: a decoder's heads and MLP columns split over processes (Megatron-LM's
layout), one rank per device.

- `shard`: which slice of each weight a rank holds, and the shard's own `ModelConfig`;
- `group`: the ranks' process group and the all-reduce the model calls;
- `protocol`: the commands rank 0 sends the workers (fixed binary headers, never pickle);
- `driver`: rank 0's side (starts the workers, sends each forward pass, gathers KV blocks);
- `worker`: the other ranks' process (a model shard and its KV cache, serving commands).
"""

from engine.parallel.shard import TensorShard, shard_model_config

__all__ = ["TensorShard", "shard_model_config"]
