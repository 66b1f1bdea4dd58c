"""Tensor parallelism's configuration."""

from __future__ import annotations

from dataclasses import dataclass

from engine_api.errors import ConfigError

# Beyond a host's GPUs; a ceiling that catches a typo before it spawns processes.
MAX_TENSOR_PARALLEL_SIZE = 16


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism (engine/parallel/): the model's attention heads and MLP columns split
    over `tensor_parallel_size` processes, one device each (`cuda:0` … on a GPU host; CPU
    processes otherwise), as Megatron-LM lays a decoder out and vLLM's `--tensor-parallel-size`
    does. The engine's process is rank 0: it schedules, samples and holds its own shard; the
    other ranks are worker processes that run each forward pass on theirs."""

    tensor_parallel_size: int = 1
    # How long a collective (a step's all-reduce, a command's broadcast) may wait for the other
    # ranks before it fails instead of hanging: a dead or stuck worker turns into an error.
    collective_timeout_s: float = 300.0

    @property
    def layout(self) -> str:
        """The layout of the KV blocks the engine hands out, in the model fingerprint
        (docs/architecture.md, "Shared contracts"): every KV head of a layer in the model's order, whatever the
        tensor-parallel size — a split cache's blocks are gathered whole as they leave and
        scattered to the ranks as they enter (engine/parallel/). So workers of different sizes
        share KV: a prefill worker at tp 4 hands its prompts to a decode worker at tp 1."""
        return "heads-whole"

    def validate(self) -> None:
        n = self.tensor_parallel_size
        if type(n) is not int or not 1 <= n <= MAX_TENSOR_PARALLEL_SIZE:
            raise ConfigError(f"tensor_parallel_size must be an integer in "
                              f"[1, {MAX_TENSOR_PARALLEL_SIZE}], got {n!r}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got "
                              f"{self.collective_timeout_s!r}")
