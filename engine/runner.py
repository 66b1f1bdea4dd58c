"""Model runner: owns the model, the physical KV cache, and one step's input tensors.

    execute(scheduler_output) = prepare inputs (one place) → forward → logits of sampling rows
                                → sample

The KV cache is a single tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
so that a block (`kv_cache[:, :, block_id]`) can be read or written in one copy for transfer.
With `kv_cache_dtype="fp8"` it is float8_e4m3fn holding K/V divided by per-layer scales
(`kv_scales [num_layers, 2]` float32, 1.0 without calibration), with "int8" int8 under scales
calibrated at start-up or read from a file (engine/attention/kv_quant.py, kv_calibration.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.attention.backend import PagedAttentionBackend
from engine.attention.forward_context import (
    AttentionMetadata,
    ForwardContext,
    current_lora,
    forward_context,
    split_decode_metadata,
)
from engine.attention.kv_calibration import (
    calibration_token_ids,
    load_kv_scales,
    round_scales,
)
from engine.attention.kv_quant import (
    default_kv_scales,
    dequantize_kv,
    kv_storage_dtype,
    quantize_kv,
    scales_from_amax,
)
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from engine.devices import indexed_device
from engine.dma_copy import copy_blocks_dma, dma_available, read_blocks_dma, write_blocks_dma
from engine.host_staging import PinnedStaging
from engine.kernels._checks import is_quantized_kv
from engine.lora import LoRABatch, LoRAStack, load_adapter
from engine.model.layers import RotaryEmbedding
from engine.model.llama import LlamaForCausalLM
from engine.model.overlap import MicroBatchStreams
from engine.model.quant import apply_fp8_w8a8, apply_int8_weight_only, check_fp8_supported
from engine.parallel.protocol import Cache, Op
from engine.parallel.shard import TensorShard, shard_model_config
from engine.parallel.step import broadcast_step, step_header
from engine.penalties import PenaltyState
from engine.piecewise_graphs import MIN_PIECEWISE_BUCKET, PiecewiseGraphRunner
from engine.pooling import PendingPooling, plan_pool_rows, pool_rows
from engine.prompt_logprobs import PendingPromptLogprobs, plan_prompt_rows, score_prompt_rows
from engine.request import Request
from engine.sampler import PendingTokens, Sampler, depends_on_outputs, to_device
from engine.scheduler import SampledToken, SchedulerOutput
from engine.spec import needs_sync
from engine.spec.rejection import PendingVerify, verify

if TYPE_CHECKING:  # engine.cuda_graphs imports this module
    from engine.cuda_graphs import CudaGraphRunner
    from engine.parallel.driver import TensorParallelDriver

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Largest verify step (sequences) captured in a CUDA graph. Each of its rows is a logits row:
# 64 x (1 + 4 drafts) x a 128k vocabulary is 82 MB of bf16 logits buffer.
SPEC_GRAPH_MAX_BATCH = 64
# A same-GPU KV copy gathers this many blocks at a time (128 MB of an 8B model's bf16 KV).
_COPY_SLICE_BLOCKS = 64


@dataclass(frozen=True, slots=True)
class RunnerResult:
    """What the runner found at start-up (never written back into the config)."""

    device: str
    dtype: torch.dtype
    num_blocks: int
    kv_dtype: torch.dtype
    block_bytes: int
    attention_backend: str
    cuda_graphs: bool


def resolve_device(name: str) -> torch.device:
    """The runner's device, a GPU always with its index (`indexed_device`)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return indexed_device(torch.device(name))


def resolve_dtype(name: str, default: torch.dtype, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16/fp16 matmuls are slow or inexact on CPUs
    return default if default != torch.float32 else torch.bfloat16


def check_decode_overlap(min_batch: int) -> int:
    """The smallest decode batch run as two overlapped micro-batches; 0: never."""
    if min_batch < 0 or min_batch == 1:
        raise ConfigError(f"decode_overlap_min_batch must be 0 (off) or >= 2, got {min_batch}")
    return min_batch


def make_attention_backend(name: str, device: torch.device) -> PagedAttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ConfigError(f"attention_backend must be torch, triton or auto, got {name!r}")


def captures_cuda_graphs(device: torch.device, enforce_eager: bool,
                         backend: PagedAttentionBackend) -> bool:
    """Whether decode steps are captured in CUDA graphs: on CUDA unless `enforce_eager`, and
    only through a backend that can be captured (the torch backend reads device values back
    to the host, which a capture forbids: that engine runs eagerly, with a warning)."""
    if device.type != "cuda" or enforce_eager:
        return False
    if not backend.captures_cuda_graphs:
        logger.warning("the %s attention backend cannot be captured in CUDA graphs; running "
                       "every step eagerly", backend.name)
        return False
    return True


def build_model(config: EngineConfig, full: ModelConfig, shard: TensorShard,
                device: torch.device, dtype: torch.dtype, backend: PagedAttentionBackend,
                max_model_len: int, weights: object, dummy_seed: int | None) -> LlamaForCausalLM:
    """The model (or, with tensor parallelism, rank `shard.rank`'s share of it) on `device`,
    its weights loaded (or random for `weights=None`) and quantized as `config` says."""
    if config.runner.quantization == "fp8" and full.is_moe:
        raise ConfigError("quantization 'fp8' (W8A8): the experts of a mixture-of-experts "
                          "model are not quantized to fp8 here; use 'int8' (weight-only, experts "
                          "included) or none (an fp8 or int8 KV cache works either way)")
    use_triton = backend.name == "triton"
    cfg = shard_model_config(full, shard.size)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, backend, max_model_len, use_triton, shard, full)
    model = model.to(dtype)
    # RoPE tables stay in fp32 whatever the model dtype.
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.rebuild_fp32()
    if weights is not None:
        model.load_weights(weights())  # type: ignore[operator]
    else:
        model.init_dummy_weights((dummy_seed or 0) + shard.rank)
    model.eval()
    quant = config.runner.quantization
    if quant != "none":
        if quant == "fp8":
            check_fp8_supported(device, dtype)
        apply = apply_fp8_w8a8 if quant == "fp8" else apply_int8_weight_only
        n = apply(model, use_triton)
        logger.info("%s quantization: %d linear layers swapped", quant, n)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the full-precision weights just freed
    return model


def cpu_kv_blocks(config: EngineConfig, block_bytes: int, max_model_len: int) -> int:
    """KV blocks of `block_bytes` a CPU engine holds: its byte budget, capped at every sequence
    at full length."""
    n = config.cache.cpu_kv_cache_bytes // block_bytes
    cap = config.scheduler.max_num_seqs * (-(-max_model_len // config.cache.block_size)) + 1
    return max(1, min(n, cap))


def gpu_kv_blocks(config: EngineConfig, device: torch.device, peak: int, block_bytes: int,
                  vocab_size: int) -> int:
    """KV blocks of `block_bytes` that fit the device once a worst-case forward peaked at
    `peak` bytes."""
    total = torch.cuda.get_device_properties(device).total_memory
    # Headroom for CUDA graphs' pools and the allocator's fragmentation, and the sampler's
    # penalty history, which grows as penalized requests arrive up to one slot per running
    # request (engine/penalties.py): kept out of the cache before it can be needed.
    reserve = 2 << 30 if not config.runner.enforce_eager else 512 << 20
    reserve += PenaltyState.bytes_for(config.scheduler.max_num_seqs, vocab_size)
    budget = int(total * config.cache.gpu_memory_utilization) - peak - reserve
    # The share above assumes this process's tensors are the device's only users; memory
    # held elsewhere (another process, an engine of this one not yet freed) must not be
    # promised to the cache, or allocating it fails outright.
    free, _ = torch.cuda.mem_get_info(device)
    if budget > free - reserve:
        logger.warning("GPU memory in use elsewhere: %.1f GiB free of %.1f GiB; the KV cache "
                       "gets %.1f GiB instead of %.1f GiB", free / 2**30, total / 2**30,
                       max(0, free - reserve) / 2**30, budget / 2**30)
        budget = free - reserve
    if budget < block_bytes * 16:
        raise ConfigError("not enough GPU memory for the KV cache; lower max_num_batched_tokens "
                          "or raise gpu_memory_utilization")
    return budget // block_bytes


def build_lora(config: EngineConfig, cfg: ModelConfig, device: torch.device,
               dtype: torch.dtype, shard: TensorShard = TensorShard(),
               use_triton: bool = False) -> LoRAStack | None:
    """The configured LoRA adapters, read, checked against `cfg` (the whole model) and on the
    device (rank `shard.rank`'s share of them under tensor parallelism); `use_triton`: the
    model runs Triton kernels, so the adapters' expand does too."""
    lora = config.lora
    lora.validate()
    if not lora.enabled:
        return None
    if config.runner.decode_overlap_min_batch:
        raise ConfigError("LoRA adapters cannot be combined with decode_overlap_min_batch")
    adapters = [load_adapter(name, path, cfg, lora.max_lora_rank) for name, path in lora.modules]
    for a in adapters:
        logger.info("LoRA adapter %s: rank %d, scaling %.4g, %s (%s)", a.name, a.rank,
                    a.scaling, ", ".join(sorted(a.targets)), a.path)
    if lora.max_loras:
        logger.info("LoRA: %d slots of rank %d (%d free for runtime loading)", lora.max_loras,
                    lora.max_lora_rank, lora.max_loras - len(adapters))
    return LoRAStack(adapters, cfg, device, dtype, shard, lora.max_loras, lora.max_lora_rank,
                     use_kernel=use_triton)


def check_tensor_parallel(config: EngineConfig, device: torch.device) -> None:
    """ConfigError for what a tensor-parallel engine does not do (yet): named, not silent."""
    if config.parallel.tensor_parallel_size == 1:
        return
    if config.runner.decode_overlap_min_batch:
        raise ConfigError("decode_overlap_min_batch cannot be combined with tensor parallelism")
    if device.type == "cuda" and not config.runner.enforce_eager:
        logger.warning("tensor parallelism runs every step eagerly: CUDA graphs are not "
                       "captured across ranks yet")


class PendingStep:
    """A launched step whose sampled tokens (and verified drafts) have not reached the host."""

    def __init__(self, tokens: PendingTokens | None, verify: PendingVerify | None = None,
                 speculative: bool = False, prompt: PendingPromptLogprobs | None = None,
                 pooled: PendingPooling | None = None) -> None:
        """speculative: the engine speculates, so requests may need their tokens on the host
        before the next step is scheduled (`needs_sync`); without it that check is skipped.
        prompt: the step's prompt logprobs, when it scored prompt tokens. pooled: its
        embedding requests' pooled rows, when it ran any (engine/pooling.py)."""
        self.tokens = tokens
        self.verify = verify
        self.prompt = prompt
        self.pooled = pooled
        reqs = (tokens.reqs if tokens is not None else []) + (verify.reqs if verify else [])
        # Drafting the next tokens (speculative decoding) needs every earlier token on the host
        # first: such a step is finished before the next one is scheduled. (Sampling that reads
        # the output history — penalties, min_tokens, a grammar — gets it from `launch`'s
        # `settle` instead, between the next step's forward pass and its sampling.)
        if speculative:
            sync = [needs_sync(r) for r in reqs]  # every counter ticks
            self.overlappable = not any(sync)
        else:
            self.overlappable = True

    def result(self) -> dict[str, SampledToken]:
        out: dict[str, SampledToken] = {}
        if self.tokens is not None:
            ids, logprobs = self.tokens.result()
            out = {r.request_id: SampledToken(tok, lp)
                   for r, tok, lp in zip(self.tokens.reqs, ids, logprobs, strict=True)}
        if self.verify is not None:
            for r, emitted in zip(self.verify.reqs, self.verify.result(), strict=True):
                out[r.request_id] = SampledToken(emitted[0], None, emitted[1:])
        return out


def _draft_probs(logits: torch.Tensor, reqs: Sequence[Request],
                 drafts: Sequence[Sequence[int]]) -> torch.Tensor | None:
    """The rejection sampler's q rows ([rows, V], zero on bonus rows) when a randomly
    sampling request's drafts were sampled from a distribution (a draft model's,
    `Request.spec_draft_probs`); other requests' drafts are one-hot. None: every draft is
    deterministic (greedy requests ignore q)."""
    if not any(r.spec_draft_probs is not None and not r.sampling_params.greedy for r in reqs):
        return None
    q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    one_hot_rows: list[int] = []
    one_hot_tokens: list[int] = []
    row = 0
    for req, d in zip(reqs, drafts, strict=True):
        probs = req.spec_draft_probs
        if isinstance(probs, torch.Tensor) and not req.sampling_params.greedy:
            q[row:row + len(d)] = probs[:len(d)]
        else:
            one_hot_rows.extend(range(row, row + len(d)))
            one_hot_tokens.extend(d)
        row += len(d) + 1
    if one_hot_rows:
        q[to_device(one_hot_rows, torch.long, q.device),
          to_device(one_hot_tokens, torch.long, q.device)] = 1.0
    return q


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 weights: object, dummy_seed: int | None, default_dtype: torch.dtype,
                 kv_calibration_ids: Callable[[], list[int]] | None = None) -> None:
        """kv_calibration_ids: the prompt a quantized cache's scales are calibrated on (called
        only when they are; default: pseudo-random ids from a fixed seed)."""
        self.tp: TensorParallelDriver | None = None
        try:
            self._build(config, model_config, max_model_len, weights, dummy_seed, default_dtype,
                        kv_calibration_ids)
        except BaseException:
            # Whatever failed after the tensor-parallel workers started (a weight, an adapter,
            # the cache's size, a capture): they and the process's group go with it, or the
            # next engine of this process could not start its own.
            if self.tp is not None:
                self.tp.shutdown()
            raise

    def _build(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
               weights: object, dummy_seed: int | None, default_dtype: torch.dtype,
               kv_calibration_ids: Callable[[], list[int]] | None) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.runner.device)
        if self.device.type == "cpu" and config.runner.cpu_threads:
            torch.set_num_threads(config.runner.cpu_threads)
        self.dtype = resolve_dtype(config.load.dtype, default_dtype, self.device)
        try:
            self.kv_dtype = kv_storage_dtype(config.cache.kv_cache_dtype, self.dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # [num_layers, 2] float32 on the CPU: (K, V) scale per layer; the wire sends these.
        # Calibrated ones are set below, once the model can run.
        self.kv_scales = default_kv_scales(model_config.num_hidden_layers)
        # The same as floats for the forward context (None: unquantized cache).
        self.kv_scale_values: list[tuple[float, float]] | None = None
        self.kv_calibration_tokens = 0  # the calibration prefill's length (0: not calibrated)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.backend = make_attention_backend(config.runner.attention_backend, self.device)
        use_triton = self.backend.name == "triton"
        self.decode_overlap_min_batch = check_decode_overlap(config.runner.decode_overlap_min_batch)
        if config.runner.cuda_graph_max_batch < 1:
            raise ConfigError(f"cuda_graph_max_batch must be >= 1, got "
                              f"{config.runner.cuda_graph_max_batch}")
        self.micro_batches = (MicroBatchStreams(self.device) if self.decode_overlap_min_batch
                              else None)
        self.num_overlapped_steps = 0  # eager steps and graph replays
        # Tensor parallelism: this process is rank 0 of `tp_size`; the driver runs the others.
        config.parallel.validate()
        check_tensor_parallel(config, self.device)
        tp_size = config.parallel.tensor_parallel_size
        self.shard = TensorShard(0, tp_size)
        # This rank's architecture (its heads, KV heads and MLP columns; the model's own at 1).
        self.shard_config = shard_model_config(model_config, tp_size)
        if tp_size > 1:
            from engine.parallel.driver import TensorParallelDriver
            self.tp = TensorParallelDriver(config, self.device, self.dtype, max_model_len)
        self.model = build_model(config, model_config, self.shard, self.device, self.dtype,
                                 self.backend, max_model_len, weights, dummy_seed)
        if self.tp is not None:
            self.tp.wait_ready()
        # LoRA adapters (engine/lora/): decode and verify steps with adapter rows replay graphs
        # that add the deltas (`lora_graphs`, `verify_graphs`); other such steps run eagerly.
        self.lora = build_lora(config, model_config, self.device, self.dtype, self.shard,
                               use_triton)
        self.num_lora_steps = 0
        self.sampler = Sampler(penalty_capacity=self.config.scheduler.max_num_seqs)
        # The stream this runner's steps and graph replays run on: the one current where it was
        # built (AsyncEngine's thread makes it current there too). Kernels that write KV into
        # this cache from other threads go on it as well, never on a side stream: a kernel on
        # any other stream, once the decode graphs are captured, slows every later decode step
        # (engine/dma_copy.py; side-stream copies go by copy engine).
        self.step_stream: torch.cuda.Stream | None = (
            torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        if self.device.type == "cuda":
            dma_available()  # finds the CUDA runtime now, not during the first KV handoff
        self._copy_stream: torch.cuda.Stream | None = None  # KV handoff copies' side stream
        # Recorded on the step stream by `fence_kv_loads` when blocks for KV loads were handed
        # out; the side stream's writes into them wait for it (see there).
        self._load_fence: torch.cuda.Event | None = None
        # The last launched step's sampled tokens (on the device) and their row per request.
        self._last_tokens: torch.Tensor | None = None
        self._staging = PinnedStaging() if self.device.type == "cuda" else None
        self._last_rows: dict[str, int] = {}
        num_blocks = self._set_up_kv_cache(config, kv_calibration_ids)
        cfg = self.shard_config
        self.kv_caches = list(self.kv_cache.unbind(0))
        if self.device.type == "cuda" and use_triton:
            from engine.attention.warmup import warm_up_attention

            scales = self.kv_scale_values[0] if self.kv_scale_values is not None else (None, None)
            n = warm_up_attention(self.kv_caches[0], cfg.num_attention_heads, self.dtype,
                                  config.scheduler.max_num_batched_tokens, *scales)
            logger.info("attention kernels warmed up: %d variants", n)
        self.graphs: CudaGraphRunner | None = None
        self.lora_graphs: CudaGraphRunner | None = None  # decode steps with LoRA adapter rows
        self.verify_graphs: CudaGraphRunner | None = None
        # Whether requests may speculate (decides which steps must finish before the next).
        self.speculative = config.speculative.enabled and config.scheduler.role != "prefill"
        # Rows per sequence of a verify step laid out for the verify graphs (0: ragged, eager).
        self.verify_q_len = 0
        self.num_uniform_verify_steps = 0
        # Other steps of up to `piecewise_graph_max_tokens` tokens: layers from graphs,
        # attention eager (engine/piecewise_graphs.py).
        self.piecewise: PiecewiseGraphRunner | None = None
        self.capture_stream: torch.cuda.Stream | None = None
        if (captures_cuda_graphs(self.device, config.runner.enforce_eager, self.backend)
                and self.tp is None):
            self._capture_graphs(config)
        self.result = RunnerResult(str(self.device), self.dtype, num_blocks, self.kv_dtype,
                                   self.block_bytes, self.backend.name, self.graphs is not None)

    def _set_up_kv_cache(self, config: EngineConfig,
                         kv_calibration_ids: Callable[[], list[int]] | None) -> int:
        """Scales (a quantized cache), size and allocation of the KV cache, on every rank;
        returns the number of blocks."""
        full, cfg = self.model_config, self.shard_config
        # A block as it leaves the engine (transfer, tiers): every KV head, whatever the split.
        self.kv_shape_per_block = (full.num_hidden_layers, 2, self.block_size,
                                   full.num_key_value_heads, full.head_dim)
        # A block as this rank holds it (its KV heads): what its memory is sized by.
        self.block_bytes = (2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads
                            * cfg.head_dim * self.kv_dtype.itemsize)
        if is_quantized_kv(self.kv_dtype):
            self.kv_scales = self._kv_scales_for(config.cache, kv_calibration_ids)
            self.kv_scale_values = [(k, v) for k, v in self.kv_scales.tolist()]
            if self.tp is not None:
                self.tp.set_kv_scales(self.kv_scales)
        num_blocks = self._num_kv_blocks()
        if self.tp is not None:
            num_blocks = self.tp.capacity(num_blocks)
            self.tp.allocate_kv(num_blocks)
        self.kv_cache = torch.zeros(cfg.num_hidden_layers, 2, num_blocks, self.block_size,
                                    cfg.num_key_value_heads, cfg.head_dim,
                                    dtype=self.kv_dtype, device=self.device)
        return num_blocks

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  md: AttentionMetadata, cache: Cache = Cache.ENGINE,
                  scratch_blocks: int = 0) -> torch.Tensor:
        """The model's forward pass (inside a forward context over `md`): with tensor
        parallelism the workers get the step first and run their shards beside this one."""
        if self.tp is None:
            return self.model(input_ids, positions)
        lora = current_lora()
        slots = None if lora is None else lora[1].token_slots
        header = step_header(input_ids, md, cache, scratch_blocks, lora=slots is not None)
        with self.tp.command(Op.FORWARD, header.fields()):
            broadcast_step(input_ids, positions, md, slots)
            return self.model(input_ids, positions)

    def _capture_graphs(self, config: EngineConfig) -> None:
        """Capture every set of CUDA graphs, all in one pool, on one side stream, the decode
        graphs last. Last because a kernel launched on a stream other than the one they replay
        on, once they are captured, measured +0.13-0.15 ms on every later decode step at batch 8
        and 64 on the H200 (not at batch 1), for the rest of the process; captured after the
        other sets they keep their speed (tools/probes/probe_stream_cost.py,
        docs/performance.md "One stream after the decode graphs")."""
        from engine.cuda_graphs import CudaGraphRunner

        stream = self.capture_stream = torch.cuda.Stream(self.device)
        max_decode_batch = min(config.runner.cuda_graph_max_batch, config.scheduler.max_num_seqs)
        pool = None
        n = min(config.runner.piecewise_graph_max_tokens, config.scheduler.max_num_batched_tokens)
        if n >= MIN_PIECEWISE_BUCKET:
            self.piecewise = PiecewiseGraphRunner(self, n, pool=pool)
            self.piecewise.capture(stream)
            pool = self.piecewise.pool
        if self.speculative:
            # Speculation is for light load (the gateway turns it off above a few requests per
            # worker): verify graphs up to SPEC_GRAPH_MAX_BATCH sequences; bigger verify steps
            # run eagerly.
            self.verify_q_len = 1 + config.speculative.num_speculative_tokens
            verify = CudaGraphRunner(self, self.verify_q_len,
                                     min(SPEC_GRAPH_MAX_BATCH, max_decode_batch), pool=pool,
                                     with_lora=self.lora is not None)
            verify.capture(stream)
            self.verify_graphs, pool = verify, verify.pool
        if self.lora is not None:
            # Decode steps with adapter rows replay graphs that add their deltas; steps of the
            # base model alone keep graphs without them (the deltas' kernels cost ~1.6 ms per
            # step of an 8B model on the H200 even when every row's delta is zero).
            lora = CudaGraphRunner(self, max_batch=max_decode_batch, pool=pool, with_lora=True)
            lora.capture(stream)
            self.lora_graphs, pool = lora, lora.pool
        decode = CudaGraphRunner(self, max_batch=max_decode_batch, pool=pool)
        decode.capture(stream)
        self.graphs = decode

    # ---- quantized KV scales ---------------------------------------------------------------

    def _kv_scales_for(self, cache: CacheConfig,
                       calibration_ids: Callable[[], list[int]] | None) -> torch.Tensor:
        """`[L, 2]` scales of a quantized cache: from the file `cache.kv_scales` names, from a
        calibration pass ("calibrate"; int8's default), or 1.0 (fp8's default)."""
        layers = self.model_config.num_hidden_layers
        source = cache.kv_scales
        if source is None:
            source = "calibrate" if self.kv_dtype == torch.int8 else None
        if source is None:
            return default_kv_scales(layers)
        if source != "calibrate":
            scales = load_kv_scales(source, layers)
            logger.info("KV cache scales from %s", source)
            return scales
        if calibration_ids is not None:
            ids = calibration_ids()
        else:
            ids = calibration_token_ids(None, self.model_config.vocab_size)
        ids = ids[:max(1, self.max_model_len)]
        amax = self.measure_kv_amax(ids)
        self.kv_calibration_tokens = len(ids)
        scales = round_scales(scales_from_amax(amax, self.kv_dtype))
        logger.info("KV cache scales calibrated on %d tokens: K %.4g..%.4g, V %.4g..%.4g",
                    len(ids), scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(),
                    scales[:, 1].max())
        return scales

    @torch.inference_mode()
    def measure_kv_amax(self, token_ids: list[int]) -> torch.Tensor:
        """One prefill of `token_ids` with a float cache → each layer's largest |K| (as cached:
        after RoPE) and |V|, `[L, 2]` float32 on the CPU."""
        _, scratch = self._scratch_prefill(token_ids, self.dtype, None, Cache.SCRATCH_FLOAT)
        amax = scratch.abs().amax(dim=(2, 3, 4, 5)).float()
        if self.tp is not None:  # the largest over every rank's heads
            import torch.distributed as dist
            with self.tp.command(Op.KV_AMAX):
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        amax = amax.cpu()
        if not bool(torch.isfinite(amax).all()):
            raise ConfigError("the KV calibration pass produced non-finite K/V; the model's "
                              "activations overflow its dtype")
        return amax

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits `[n, vocab]` (float32, CPU) of every position of one prefill of `token_ids`
        over a scratch cache of this runner's KV dtype and scales: every position reads its own
        and earlier K/V back from the cache, as decoding does (accuracy probes)."""
        hidden, _ = self._scratch_prefill(token_ids, self.kv_dtype, self.kv_scale_values,
                                          Cache.SCRATCH_KV)
        return self.model.compute_logits(hidden).float().cpu()

    def _scratch_prefill(self, token_ids: list[int], kv_dtype: torch.dtype,
                         scales: list[tuple[float, float]] | None, cache: Cache
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """One prefill of `token_ids` into a fresh cache of `kv_dtype` (not the engine's) →
        (hidden states [n, hidden], that cache [L, 2, blocks, bs, Hkv, D])."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("a scratch prefill needs at least one token")
        blocks = -(-n // self.block_size)
        scratch = torch.zeros(self.shard_config.num_hidden_layers, 2, blocks,
                              *self._local_block_shape, dtype=kv_dtype, device=self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        md = self._metadata_for_profile(n)
        with forward_context(ForwardContext(md, list(scratch.unbind(0)), scales)):
            hidden = self.run_model(ids, pos, md, cache, blocks)
        return hidden, scratch

    # ---- sizing ----------------------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if self.device.type != "cuda":
            return cpu_kv_blocks(self.config, self.block_bytes, self.max_model_len)
        return self._profile_gpu_blocks()

    @property
    def _local_block_shape(self) -> tuple[int, int, int]:
        """(block_size, KV heads, head_dim) of a block of this rank's cache."""
        cfg = self.shard_config
        return (self.block_size, cfg.num_key_value_heads, cfg.head_dim)

    @torch.inference_mode()
    def _profile_gpu_blocks(self) -> int:
        """Free memory after a worst-case forward (max batched tokens) bounds the KV cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        blocks = -(-n // self.block_size) + 1
        scratch = torch.zeros(self.shard_config.num_hidden_layers, 2, blocks,
                              *self._local_block_shape, dtype=self.kv_dtype, device=self.device)
        md = self._metadata_for_profile(n)
        with forward_context(ForwardContext(md, list(scratch.unbind(0)), self.kv_scale_values)):
            h = self.run_model(ids, pos, md, Cache.PROFILE, blocks)
            self.model.compute_logits(h[-min(n, self.config.scheduler.max_num_seqs):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del scratch, h
        torch.cuda.empty_cache()
        return gpu_kv_blocks(self.config, self.device, peak, self.block_bytes,
                             self.model.lm_head_weight.shape[0])

    def _metadata_for_profile(self, n: int) -> AttentionMetadata:
        nb = -(-n // self.block_size)
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
            slot_mapping=torch.arange(n, dtype=torch.long, device=dev),
            num_decodes=0, max_query_len=n, max_seq_len=n,
            query_start_loc_cpu=[0, n], seq_lens_cpu=[n])

    # ---- one step --------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput, uniform_q: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the scheduled requests into the step's tensors (the only place that does).

        uniform_q > 0 (a verify step for the graphs of `verify_graphs`; every request at its
        last known token): each request gets exactly `uniform_q` rows, its token and drafts
        first, then padding rows (token 0, no KV write: slot -1); its length counts them, so the
        real rows' causal window is unchanged and only padding rows see past it.

        Host data is laid out in two pinned buffers reused across steps (int64: ids |
        positions | slots | logit rows | in-flight gathers; int32: query_start_loc | seq_lens |
        block_tables; engine/host_staging.py) and moved with two async copies.
        Returns (input_ids [T], positions [T], metadata, logit row per sampling request [S] on
        the device: indexing the hidden states with a host list would copy it from pageable
        memory, which waits for the whole forward before the LM head can be launched)."""
        bs = self.block_size
        sched = out.scheduled
        num_seqs = len(sched)
        if uniform_q:
            num_tokens = num_seqs * uniform_q
            # Padding rows' positions reach up to `uniform_q - 1` past the real ones: their
            # (unwritten, never used) KV must stay inside the table.
            max_blocks = max(-(-(s.num_computed_tokens + uniform_q) // bs) for s in sched)
        else:
            num_tokens = out.num_batched_tokens or sum(s.num_new_tokens for s in sched)
            max_blocks = max(len(s.block_ids) for s in sched)
        # Inputs still in flight (async scheduling): (row in this step, row of the last step's
        # sampled tokens). At most one per request: its last sampled token.
        # (A request verifying drafts reaches past its known tokens by them, not by a token
        # in flight: it has none.)
        inflight = [(i, s) for i, s in enumerate(sched)
                    if s.num_computed_tokens + s.num_new_tokens > s.request.num_tokens
                    and not s.draft_token_ids]
        num_gather = len(inflight)
        # One logits row per sampling request; one per query row when it verifies drafts.
        num_sample = sum(1 + len(s.draft_token_ids) for s in sched if s.sample)
        num_int64 = 3 * num_tokens + num_sample + 2 * num_gather
        num_int32 = 2 * num_seqs + 1 + num_seqs * max_blocks
        if self._staging is not None:  # pinned, reused (engine/host_staging.py)
            big, small = self._staging.take(num_int64, num_int32)
        else:  # the CPU (`.to(device)` below returns these very tensors: fresh each step)
            pin = self.device.type == "cuda"  # (staging turned off: tools/probes/probe_ttft_host.py)
            big = torch.empty(num_int64, dtype=torch.int64, pin_memory=pin)
            small = torch.zeros(num_int32, dtype=torch.int32, pin_memory=pin)
        b64, b32 = big.numpy(), small.numpy()
        ids, pos = b64[:num_tokens], b64[num_tokens:2 * num_tokens]
        slots = b64[2 * num_tokens:3 * num_tokens]
        rows_at = 3 * num_tokens
        logit_rows = b64[rows_at:rows_at + num_sample]
        gather = b64[rows_at + num_sample:].reshape(2, num_gather)  # [dst rows; src rows]
        qsl, seq_lens = b32[:num_seqs + 1], b32[num_seqs + 1:2 * num_seqs + 1]
        tables = b32[2 * num_seqs + 1:].reshape(num_seqs, max_blocks)
        num_sampled = 0
        num_decodes = 0
        o = 0
        for i, s in enumerate(sched):
            start, n = s.num_computed_tokens, s.num_new_tokens
            end = start + n
            table = s.block_ids
            tables[i, :len(table)] = table
            known = s.request.num_tokens
            if n == 1:  # decode: scalar path, no per-row numpy temporaries
                ids[o] = s.request.all_token_ids[start] if start < known else 0
                pos[o] = start
                slots[o] = table[start // bs] * bs + start % bs
                if not uniform_q:
                    num_decodes += 1
            else:
                p = np.arange(start, end)
                ids[o:o + min(n, known - start)] = s.request.all_token_ids[start:end]
                if s.draft_token_ids:  # the last known token, then the drafts
                    ids[o + 1:o + n] = s.draft_token_ids
                pos[o:o + n] = p
                slots[o:o + n] = tables[i, p // bs].astype(np.int64) * bs + p % bs
            if s.sample and s.draft_token_ids:
                logit_rows[num_sampled:num_sampled + n] = np.arange(o, o + n)
                num_sampled += n
            elif s.sample:
                logit_rows[num_sampled] = o + n - 1
                num_sampled += 1
            if uniform_q:
                if n < uniform_q:
                    ids[o + n:o + uniform_q] = 0
                    pos[o + n:o + uniform_q] = np.minimum(np.arange(end, start + uniform_q),
                                                          self.max_model_len - 1)
                    slots[o + n:o + uniform_q] = -1
                end = start + uniform_q
                n = uniform_q
            o += n
            qsl[i + 1] = o
            seq_lens[i] = end
        qsl[0] = 0
        for j, (i, s) in enumerate(inflight):
            # The request's last real row in this step (padding rows follow it when uniform).
            gather[0, j] = int(qsl[i]) + s.num_new_tokens - 1
            gather[1, j] = self._last_sampled_row(s.request.request_id)
        dev = self.device
        big_d = big.to(dev, non_blocking=True)
        small_d = small.to(dev, non_blocking=True)
        if self._staging is not None:
            self._staging.copied()
        if num_gather:
            assert self._last_tokens is not None
            g = big_d[rows_at + num_sample:].view(2, num_gather)
            big_d[:num_tokens].index_copy_(0, g[0], self._last_tokens.index_select(0, g[1]))
        seq_lens_cpu = seq_lens.tolist()
        md = AttentionMetadata(
            query_start_loc=small_d[:num_seqs + 1], seq_lens=small_d[num_seqs + 1:2 * num_seqs + 1],
            block_tables=small_d[2 * num_seqs + 1:].view(num_seqs, max_blocks),
            slot_mapping=big_d[2 * num_tokens:3 * num_tokens], num_decodes=num_decodes,
            max_query_len=uniform_q or max(s.num_new_tokens for s in sched),
            max_seq_len=max(seq_lens_cpu),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens_cpu,
            uniform_query_len=uniform_q if uniform_q > 1 else 0)
        return (big_d[:num_tokens], big_d[num_tokens:2 * num_tokens], md,
                big_d[rows_at:rows_at + num_sample])

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step and wait for its sampled tokens."""
        pending = self.launch(out)
        return {} if pending is None else pending.result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, keep_probs: bool = False,
               settle: Callable[[], None] | None = None) -> PendingStep | None:
        """Enqueue one step's forward pass and sampling without waiting for the device.

        The sampled tokens stay on the device too, so the next step may take them as inputs
        before they reach the host (async scheduling). None when nothing is sampled.
        `keep_probs`: the sampled tokens keep their distributions (a draft model's steps).
        `settle`: finishes the step still in flight (async scheduling); called after the
        forward pass is queued and before sampling when a sampled request reads its output
        history (a grammar's mask, penalties, min_tokens), which needs that step's token."""
        if out.is_empty:
            return None
        uniform_q = self._verify_rows(out)
        self.num_uniform_verify_steps += bool(uniform_q)
        input_ids, positions, md, logit_rows = self.prepare(out, uniform_q)
        sampling_reqs = [s.request for s in out.scheduled if s.sample]
        # (A uniform verify step holds no prompt rows: every request in it is decoding. Nor
        # embedding requests, which sample nothing: no step with them replays a graph.)
        prompt_rows = (plan_prompt_rows(out.scheduled) if out.scores_prompt and not uniform_q
                       else [])
        prompt: PendingPromptLogprobs | None = None
        pool_plans = plan_pool_rows(out.scheduled) if out.pools else []
        pooled: PendingPooling | None = None
        lora = self._lora_for(out, md)
        slots = None if lora is None else lora[1].token_slots
        self.num_lora_steps += lora is not None
        if uniform_q and self.verify_graphs is not None:
            logits = self.verify_graphs.run(input_ids, positions, md, slots).index_select(
                0, logit_rows)
        elif (self.graphs is not None and out.is_pure_decode and not prompt_rows
                and len(sampling_reqs) == len(out.scheduled)
                and self.graphs.can_run(len(out.scheduled))):
            # Every decode samples, so the graph's logits rows are the sampling rows. Rows that
            # run LoRA adapters: the graphs that add their deltas.
            graphs = self.graphs if lora is None or self.lora_graphs is None else self.lora_graphs
            logits = graphs.run(input_ids, positions, md, slots)
        else:
            with forward_context(ForwardContext(md, self.kv_caches, self.kv_scale_values,
                                                lora)):
                if lora is not None:  # the piecewise graphs hold no LoRA deltas
                    hidden = self.run_model(input_ids, positions, md)
                elif out.is_pure_decode and self.overlaps(len(out.scheduled)):
                    self.num_overlapped_steps += 1
                    hidden = self.forward_overlapped(input_ids, positions, md)
                elif self.piecewise is not None and self.piecewise.can_run(len(input_ids)):
                    hidden = self.piecewise.run(input_ids, positions, md)
                else:
                    hidden = self.run_model(input_ids, positions, md)
            if prompt_rows:
                prompt = score_prompt_rows(hidden, prompt_rows, self.model.compute_logits)
            if pool_plans:
                pooled = pool_rows(hidden, pool_plans)
            if not sampling_reqs:
                if prompt is None and pooled is None:
                    return None
                return PendingStep(None, prompt=prompt, pooled=pooled)
            logits = self.model.compute_logits(hidden.index_select(0, logit_rows))
        if settle is not None and any(r.grammar is not None or depends_on_outputs(r)
                                      for r in sampling_reqs):
            settle()
        if out.has_drafts:
            pending = self._sample_and_verify(logits, out, prompt)
        else:
            tokens = self.sampler.sample(logits, sampling_reqs, keep_probs)
            self._last_tokens = tokens.tokens
            self._last_rows = {r.request_id: i for i, r in enumerate(sampling_reqs)}
            pending = PendingStep(tokens, speculative=self.speculative, prompt=prompt)
        pending.pooled = pooled
        return pending

    def _verify_rows(self, out: SchedulerOutput) -> int:
        """Rows per sequence when this step replays a verify graph (else 0): a step with drafts
        in which every request is at its last known token."""
        q = self.verify_q_len
        if not q or not out.has_drafts or any(s.num_new_tokens != 1 + len(s.draft_token_ids)
                                               for s in out.scheduled):
            return 0
        return q if self._fits_uniform(out, q, self.verify_graphs) else 0

    def _fits_uniform(self, out: SchedulerOutput, q: int,
                      graphs: CudaGraphRunner | None) -> bool:
        """Whether a step can be laid out with `q` rows per sequence (`prepare(uniform_q=q)`):
        every request samples (its logits row is its last real one), the step fits a bucket of
        `graphs` (when captured), and no padding row reaches past the context's end."""
        return ((graphs is None or graphs.can_run(len(out.scheduled)))
                and all(s.sample and s.num_computed_tokens + q <= self.max_model_len
                        for s in out.scheduled))

    def _sample_and_verify(self, logits: torch.Tensor, out: SchedulerOutput,
                           prompt: PendingPromptLogprobs | None = None) -> PendingStep:
        """Split the logits rows: requests with drafts go to the rejection sampler (all their
        rows), the others to the sampler (their one row)."""
        plain_rows: list[int] = []
        plain_reqs: list[Request] = []
        spec_rows: list[int] = []
        spec_reqs: list[Request] = []
        drafts: list[Sequence[int]] = []
        row = 0
        for s in out.scheduled:
            if not s.sample:
                continue
            if s.draft_token_ids:
                n = 1 + len(s.draft_token_ids)
                spec_rows.extend(range(row, row + n))
                spec_reqs.append(s.request)
                drafts.append(s.draft_token_ids)
                row += n
            else:
                plain_rows.append(row)
                plain_reqs.append(s.request)
                row += 1
        dev = logits.device
        tokens = None
        if plain_reqs:
            idx = to_device(plain_rows, torch.long, dev)
            tokens = self.sampler.sample(logits.index_select(0, idx), plain_reqs)
            self._last_tokens = tokens.tokens
        # The step finishes before the next is scheduled (PendingStep.overlappable), so no
        # later step gathers its tokens on the device.
        self._last_rows = {}
        spec_idx = to_device(spec_rows, torch.long, dev)
        spec_logits = logits.index_select(0, spec_idx)
        return PendingStep(tokens, verify(spec_logits, spec_reqs, drafts,
                                          _draft_probs(spec_logits, spec_reqs, drafts)),
                           speculative=True, prompt=prompt)

    def _lora_for(self, out: SchedulerOutput, md: AttentionMetadata) -> tuple[
            LoRAStack, LoRABatch] | None:
        """Each of the step's rows' LoRA adapter slot (None: no row runs an adapter)."""
        if self.lora is None or not any(s.request.lora_slot for s in out.scheduled):
            return None
        qsl = md.query_start_loc_cpu
        slots = np.zeros(qsl[-1], dtype=np.int64)
        for i, s in enumerate(out.scheduled):
            slots[qsl[i]:qsl[i + 1]] = s.request.lora_slot
        return self.lora, LoRABatch(torch.from_numpy(slots).to(self.device, non_blocking=True))

    def overlaps(self, num_decodes: int) -> bool:
        """Whether a pure-decode batch this large runs as two overlapped micro-batches."""
        return 0 < self.decode_overlap_min_batch <= num_decodes

    def forward_overlapped(self, input_ids: torch.Tensor, positions: torch.Tensor,
                           md: AttentionMetadata) -> torch.Tensor:
        """The model over a pure-decode batch as two micro-batches (inside a forward context)."""
        assert self.micro_batches is not None
        halves = split_decode_metadata(md, input_ids.shape[0] // 2)
        return self.model.forward_overlapped(input_ids, positions, halves, self.micro_batches)

    def _last_sampled_row(self, request_id: str) -> int:
        row = self._last_rows.get(request_id)
        if row is None:
            raise RuntimeError(f"request {request_id!r} has a token in flight that the last "
                               "launched step did not sample")
        return row

    @torch.inference_mode()
    def logits_for(self, out: SchedulerOutput) -> torch.Tensor:
        """Forward one scheduled step and return the logits of every token (tests/oracles)."""
        input_ids, positions, md, _ = self.prepare(out)
        with forward_context(ForwardContext(md, self.kv_caches, self.kv_scale_values,
                                            self._lora_for(out, md))):
            hidden = self.run_model(input_ids, positions, md)
        return self.model.compute_logits(hidden)

    def release(self) -> None:
        """Give back the device memory this runner holds (captured graphs and their pools, the
        KV cache, the weights), without waiting for the garbage collector; the runner is
        unusable after (its engine refuses to step)."""
        if self.tp is not None:
            self.tp.shutdown()
        self.graphs = None
        self.lora_graphs = None
        self.verify_graphs = None
        self.piecewise = None
        self._last_tokens = None
        self.kv_caches = []
        self.kv_cache = self.kv_cache.new_empty(0)
        self.model.to("meta")  # parameters and buffers lose their storage
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- KV blocks for transfer ------------------------------------------------------------

    @property
    def kv_is_quantized(self) -> bool:
        """True for a 1-byte (fp8 or int8) cache, whose blocks travel with `kv_scales`."""
        return self.kv_dtype.itemsize == 1

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """→ CPU tensor [n, num_layers, 2, block_size, Hkv, D] in the cache dtype (a copy; fp8 and
        int8 blocks are the stored values: multiply by `kv_scales` [L, 2] to get K/V)."""
        with self._on_step_stream():
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            if self.tp is not None:
                host = self._gather_sharded_blocks(idx).to("cpu").contiguous()
            else:
                host = self._gather_blocks(idx).to("cpu").contiguous()
        return host.view(self.kv_dtype) if self.kv_is_quantized else host

    def _gather_sharded_blocks(self, idx: torch.Tensor) -> torch.Tensor:
        """`_gather_blocks` over every rank: each holds its KV heads of the blocks; they are
        gathered here and laid side by side, in rank order, as the model's KV heads are."""
        assert self.tp is not None
        import torch.distributed as dist
        with self.tp.command(Op.READ_BLOCKS, [int(idx.shape[0])]):
            dist.broadcast(idx, src=0)
            local = self._gather_blocks(idx).contiguous()
            parts = [torch.empty_like(local) for _ in range(self.shard.size)]
            dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=4)

    def _gather_blocks(self, idx: torch.Tensor) -> torch.Tensor:
        """The cache's blocks `idx` as [n, num_layers, 2, block_size, Hkv, D] on the device
        (the raw bytes of a 1-byte cache: index_select has no fp8 kernel on the CPU)."""
        src = self.kv_cache.view(torch.uint8) if self.kv_is_quantized else self.kv_cache
        return src.index_select(2, idx).permute(2, 0, 1, 3, 4, 5)

    def read_leased_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """`read_blocks` for blocks that no kernel writes while they are read (a prefill
        worker's leased prompt: computed before the lease existed, kept until its release).

        On a GPU the copy runs on a side stream and the host waits for the copy alone. Through
        the engine's stream (`read_blocks`) it waited for every step queued before it: on a
        busy prefill worker, up to a step per call, for every block a decode worker pulls. The
        copy engines move the blocks straight into pinned memory (engine/dma_copy.py says
        why no kernel); without them (no CUDA runtime to call) a gather kernel does, on the
        same side stream."""
        stream = self._side_stream()
        if stream is None or self.tp is not None:
            return self.read_blocks(block_ids)
        if dma_available():
            host = torch.empty((len(block_ids), *self.kv_shape_per_block), dtype=self.kv_dtype,
                               pin_memory=True)
            read_blocks_dma(self.kv_cache, block_ids, host, stream)
            stream.synchronize()
            return host
        with torch.cuda.stream(stream):
            blocks = self._gather_blocks(to_device(block_ids, torch.long, self.device))
            host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
            host.copy_(blocks, non_blocking=True)
        stream.synchronize()
        return host.view(self.kv_dtype) if self.kv_is_quantized else host

    def copy_blocks_from(self, block_ids: list[int], src_cache: torch.Tensor,
                         src_block_ids: list[int]) -> None:
        """Blocks `src_block_ids` of another cache of this layout (another process's, mapped
        through CUDA IPC, on this GPU or a peer) → this cache's `block_ids`; returns when done.

        From this GPU: by the copy engines on the side stream, waiting only for the steps that
        may still write these blocks stale (`fence_kv_loads`). Otherwise
        (a peer GPU's cache, or no CUDA runtime to call) by kernels on the step stream, after
        the steps already queued there: a kernel on a side stream, once the decode graphs are
        captured, measured +0.14 ms on every later batch-8 decode step of this process
        (tools/probes/probe_stream_cost.py --variant kv_copy; engine/dma_copy.py)."""
        if self.tp is not None:
            raise ValueError("a tensor-parallel engine's cache is split over its ranks; its KV "
                             "travels by shared memory or gRPC, not by one cache's IPC handle")
        side = self._side_stream()
        if side is not None and src_cache.device == self.kv_cache.device and dma_available():
            self._wait_for_load_fence(side)
            copy_cache_blocks(self.kv_cache, block_ids, src_cache, src_block_ids,
                              dma_streams=[side])
        else:
            copy_cache_blocks(self.kv_cache, block_ids, src_cache, src_block_ids,
                              self.step_stream)

    def fence_kv_loads(self) -> None:
        """Called by the engine's thread after a schedule handed out blocks for KV loads and
        before it launches the step: records where the step stream is.

        A block freed by the host can still be written by a step already launched (a request
        that finished or was preempted while its next token was in flight writes that token's
        K/V). The loads write their blocks from the side stream, unordered with the steps, so
        each write first waits for this event: for the steps launched before its blocks were
        handed out, which alone can hold a stale write to them, and not for the ones after."""
        if self.device.type != "cuda":
            return
        fence = torch.cuda.Event()
        fence.record(self.step_stream or torch.cuda.current_stream(self.device))
        self._load_fence = fence

    def _side_stream(self) -> torch.cuda.Stream | None:
        """The stream KV handoff copies run on beside the engine's steps (None on a CPU)."""
        if self.device.type != "cuda":
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    def _wait_for_load_fence(self, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait (on the device) for the last `fence_kv_loads`, before it writes a
        KV load's blocks."""
        fence = self._load_fence
        if fence is not None:
            stream.wait_event(fence)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor,
                     scales: torch.Tensor | None = None) -> None:
        """blocks: [n, num_layers, 2, block_size, Hkv, D] → kv_cache at block_ids.

        Quantized (fp8 or int8) cache: blocks of its dtype are stored values under `scales`
        ([L, 2]; None = this runner's `kv_scales`) and are re-quantized when those differ from
        ours; float blocks are real K/V values, quantized with our scales (saturating at ±448 or
        ±127 times the scale). Called from threads other than the engine's; returns when the
        blocks are in the cache."""
        expected = (len(block_ids), *self.kv_shape_per_block)
        if tuple(blocks.shape) != expected:
            raise ValueError(f"KV blocks have shape {tuple(blocks.shape)}, expected {expected}")
        if self.kv_is_quantized:
            src, cache = self._quantize_blocks(blocks, scales), self.kv_cache.view(torch.uint8)
        elif scales is not None:
            raise ValueError(f"scales are only for fp8 and int8 KV caches, this one is "
                             f"{self.kv_dtype}")
        else:
            src, cache = blocks, self.kv_cache
        if self.tp is not None:
            self._scatter_sharded_blocks(block_ids, src, cache)
            return
        stream = self._side_stream()
        if (stream is not None and src.device.type == "cpu" and src.dtype == cache.dtype
                and dma_available()):
            # From the host by copy engine on the side stream: the blocks belong to a load no
            # step reads before it completes, so this waits only for the steps that may still
            # write them stale (`fence_kv_loads`), not for every queued one (a kernel would: on
            # the step stream, engine/dma_copy.py says why).
            self._wait_for_load_fence(stream)
            write_blocks_dma(cache, block_ids, src.contiguous(), stream)
            stream.synchronize()  # `blocks` may be a staging buffer reused after
            return
        if self.step_stream is not None:  # after what the caller queued on its own stream
            self.step_stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_step_stream():
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            dev = src.to(self.device, cache.dtype, non_blocking=True)
            cache.index_copy_(2, idx, dev.permute(1, 2, 0, 3, 4, 5))
        if self.step_stream is not None:
            self.step_stream.synchronize()  # `blocks` may be a staging buffer reused after

    def _scatter_sharded_blocks(self, block_ids: list[int], src: torch.Tensor,
                                cache: torch.Tensor) -> None:
        """`write_blocks` over every rank: blocks of every KV head (`src`, in `cache`'s dtype or
        its bytes) are cut by head into the ranks' shares and each rank writes its own."""
        assert self.tp is not None
        import torch.distributed as dist
        comm = self.device
        idx = torch.tensor(block_ids, dtype=torch.long, device=comm)
        parts = [p.to(comm, cache.dtype).contiguous()
                 for p in src.chunk(self.shard.size, dim=4)]
        with self._on_step_stream(), self.tp.command(Op.WRITE_BLOCKS, [len(block_ids)]):
            dist.broadcast(idx, src=0)
            mine = torch.empty_like(parts[0])
            dist.scatter(mine, parts, src=0)
            cache.index_copy_(2, idx, mine.permute(1, 2, 0, 3, 4, 5))
        if self.step_stream is not None:
            self.step_stream.synchronize()

    def _on_step_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Makes `step_stream` current in a thread other than the engine's (a no-op on a CPU)."""
        if self.step_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.step_stream)

    def _quantize_blocks(self, blocks: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """blocks [n, L, 2, bs, Hkv, D] → the uint8 bytes of this cache's values (fp8 or int8)
        under `kv_scales`."""
        ours = self.kv_scales.view(1, -1, 2, 1, 1, 1)  # broadcast over [n, L, 2, bs, Hkv, D]
        if blocks.dtype == self.kv_dtype:
            if scales is None or torch.equal(scales.float().cpu(), self.kv_scales):
                return blocks.contiguous().view(torch.uint8)
            if tuple(scales.shape) != tuple(self.kv_scales.shape):
                raise ValueError(f"KV scales have shape {tuple(scales.shape)}, expected "
                                 f"{tuple(self.kv_scales.shape)}")
            values = dequantize_kv(blocks.cpu(), scales.float().cpu().view(1, -1, 2, 1, 1, 1))
            return quantize_kv(values, ours, self.kv_dtype).view(torch.uint8)
        if scales is not None:
            raise ValueError(f"scales come with {self.kv_dtype} blocks, not with {blocks.dtype} "
                             "ones")
        if is_quantized_kv(blocks.dtype):
            raise ValueError(f"{blocks.dtype} blocks cannot enter a {self.kv_dtype} cache")
        return quantize_kv(blocks.cpu(), ours, self.kv_dtype).view(torch.uint8)


def copy_cache_blocks(dst_cache: torch.Tensor, dst_block_ids: list[int], src_cache: torch.Tensor,
                      src_block_ids: list[int], stream: torch.cuda.Stream | None = None,
                      dma_streams: Sequence[torch.cuda.Stream] = ()) -> None:
    """dst_cache[:, :, dst_block_ids] = src_cache[:, :, src_block_ids] for two caches
    [L, 2, num_blocks, block_size, Hkv, D] of one dtype (1-byte caches moved as raw bytes),
    `_COPY_SLICE_BLOCKS` blocks at a time; on `stream` if given, and then waits for it. The
    source may be on another GPU (a peer of the destination's): each slice is gathered there
    and copied across (torch orders the copy after the gather and before the scatter).
    `dma_streams`: by the copy engines instead, on those streams (`stream` unused), one 2-D
    copy per run of consecutive blocks and stream (both caches on one GPU; engine/dma_copy.py;
    more than one stream measured slower, tools/probes/probe_kv_dma.py). Raises ValueError when the
    caches' blocks differ, IndexError for a block id out of range."""
    if len(dst_block_ids) != len(src_block_ids):
        raise ValueError(f"{len(dst_block_ids)} blocks to fill from {len(src_block_ids)}")
    expected = (*dst_cache.shape[:2], *dst_cache.shape[3:])
    got = (*src_cache.shape[:2], *src_cache.shape[3:])
    same_place = src_cache.device == dst_cache.device or (
        src_cache.device.type == dst_cache.device.type == "cuda")
    if got != expected or src_cache.dtype != dst_cache.dtype or not same_place:
        raise ValueError(f"source cache {tuple(src_cache.shape)} {src_cache.dtype} on "
                         f"{src_cache.device} does not match the destination's blocks "
                         f"{tuple(dst_cache.shape)} {dst_cache.dtype} on {dst_cache.device}")
    if dma_streams:
        if src_cache.device != dst_cache.device or dst_cache.device.type != "cuda":
            raise ValueError("a DMA block copy needs both caches on one GPU")
        copy_blocks_dma(dst_cache, dst_block_ids, src_cache, src_block_ids, dma_streams)
        for s in dma_streams:
            s.synchronize()
        return
    one_byte = dst_cache.element_size() == 1  # fp8 / int8: index kernels work on the raw bytes
    dst = dst_cache.view(torch.uint8) if one_byte else dst_cache
    src = src_cache.view(torch.uint8) if one_byte else src_cache
    device = dst_cache.device
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for i in range(0, len(dst_block_ids), _COPY_SLICE_BLOCKS):
            dst_idx = to_device(dst_block_ids[i:i + _COPY_SLICE_BLOCKS], torch.long, device)
            src_idx = to_device(src_block_ids[i:i + _COPY_SLICE_BLOCKS], torch.long, src.device)
            dst.index_copy_(2, dst_idx, src.index_select(2, src_idx).to(device))
    if stream is not None:
        stream.synchronize()
