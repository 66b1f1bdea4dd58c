"""The model runner's configuration: device, attention backend, CUDA graphs, quantization."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine_api.errors import ConfigError

AttentionBackendName = Literal["torch", "triton", "auto"]


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How the forward pass runs."""

    device: str = "auto"                    # "auto": cuda if available else cpu
    attention_backend: AttentionBackendName = "auto"
    enforce_eager: bool = False             # True: no CUDA graphs
    # Largest decode batch captured in a CUDA graph (and not above max_num_seqs); bigger
    # decode steps run eagerly. 512 as in vLLM: each bucket costs capture time and pool memory.
    cuda_graph_max_batch: int = 512
    # Decode steps of at least this many sequences run as two micro-batches on two CUDA
    # streams, one half's attention beside the other's MLP (engine/model/overlap.py). 0: never,
    # the default: on the H200 it measured slower (docs/performance.md).
    decode_overlap_min_batch: int = 0
    quantization: Literal["none", "fp8", "int8"] = "none"
    # Intra-op threads on the CPU; None keeps torch's default, capped at the CPUs the process
    # may use (engine_api/cpus.py: affinity and cgroup quota). Several engines (or an engine and
    # its tests) on one small machine must split the cores, or spinning thread pools oversubscribe
    # them and small ops get ~100x slower.
    cpu_threads: int | None = None
    # Other steps of at most this many tokens (prompts and chunks, decodes beside them) replay
    # piecewise CUDA graphs: each layer's norms, matmuls, RoPE and KV write from a graph per
    # token-count bucket, attention launched eagerly between them (engine/piecewise_graphs.py).
    # On the H200 (8B): a prompt's first token 15-17 ms eager -> 5.3-12.2 ms for 5-512 tokens.
    # 0: off.
    piecewise_graph_max_tokens: int = 512

    def validate(self) -> None:
        n = self.piecewise_graph_max_tokens
        if type(n) is not int or not (n == 0 or 16 <= n <= MAX_PIECEWISE_GRAPH_TOKENS):
            raise ConfigError(f"piecewise_graph_max_tokens must be 0 (off) or in "
                              f"[16, {MAX_PIECEWISE_GRAPH_TOKENS}], got {n!r}")


# Past ~2k tokens a step's kernels outlast its eager launches (a 1,024-token prompt: 20.5 ms of
# kernels against ~2 ms of gaps on the H200), so graphs gain nothing and cost pool memory.
MAX_PIECEWISE_GRAPH_TOKENS = 2048
