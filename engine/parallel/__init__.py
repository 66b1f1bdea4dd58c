"""Tensor parallelism: a decoder's heads and MLP columns split over processes (Megatron-LM's
layout), one rank per device.

- `shard`: which slice of each weight a rank holds, and the shard's own `ModelConfig`;
- `group`: the ranks' process group and the all-reduce the model calls;
- `protocol`: the commands rank 0 sends the workers (fixed binary headers, never pickle) and
  what a worker process is started with.

The processes that use these (rank 0's driver, the workers, a step's tensors on the wire) build
and run models, so they live with the model runner, above the model and LoRA code that imports
this package: engine/runner/tp_driver.py, tp_worker.py and tp_step.py.
"""

from engine.parallel.shard import TensorShard, shard_model_config

__all__ = ["TensorShard", "shard_model_config"]
