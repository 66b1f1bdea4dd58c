"""The model runner: one engine's model, KV cache, CUDA graphs and steps (`ModelRunner`).

- `model_runner`: `ModelRunner`, what the engine talks to; it delegates to the modules below;
- `model_build`: device, dtype, attention backend, the model and its LoRA adapters;
- `kv_memory` / `kv_sizing`: the KV cache's scales, size and allocation;
- `graph_capture`: which CUDA graphs are captured (engine/cuda_graphs.py, piecewise_graphs.py);
- `step_inputs`: a step's tensors from the scheduled requests;
- `sampling`: a step's logits to tokens (`PendingStep`), drafts through the rejection sampler;
- `block_io`: KV blocks in and out of the cache for the KV handoff;
- `tp_driver` / `tp_worker` / `tp_step`: tensor parallelism's other ranks (engine/parallel/
  holds the sharding, the process group and the wire format they share with the model).
"""

from engine.runner.model_runner import ModelRunner, RunnerResult
from engine.runner.sampling import PendingStep

__all__ = ["ModelRunner", "PendingStep", "RunnerResult"]
