"""Model runner: owns the model, the physical KV cache, and one step's input tensors.

    execute(scheduler_output) = prepare inputs (one place) → forward → logits of sampling rows
                                → sample

`ModelRunner` is what the engine talks to; the work is done by the modules beside this one:
model_build (device, dtype, backend, model, adapters), kv_memory (the KV cache's scales, size
and allocation), graph_capture (CUDA graphs), step_inputs (a step's tensors), sampling and
block_io (KV blocks in and out for the handoff), tp_driver (the other tensor-parallel ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.forward_context import (
    AttentionMetadata,
    ForwardContext,
    current_lora,
    forward_context,
    split_decode_metadata,
)
from engine.attention.kv_channels import qk_dot_on_int8
from engine.attention.kv_quant import kv_storage_dtype
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.cuda_graphs import CudaGraphRunner
from engine.model.overlap import MicroBatchStreams
from engine.parallel.protocol import Cache, Op
from engine.parallel.shard import TensorShard, shard_model_config
from engine.piecewise_graphs import PiecewiseGraphRunner
from engine.pooling import PendingPooling, plan_pool_rows, pool_rows
from engine.prompt_logprobs import PendingPromptLogprobs, plan_prompt_rows, score_prompt_rows
from engine.runner.block_io import BlockIO
from engine.runner.cpu_threads import set_cpu_threads
from engine.runner.graph_capture import capture_graphs, captures_cuda_graphs
from engine.runner.kv_memory import KVMemory
from engine.runner.model_build import (
    build_lora,
    build_model,
    check_decode_overlap,
    check_tensor_parallel,
    make_attention_backend,
    resolve_device,
    resolve_dtype,
)
from engine.runner.sampling import PendingStep, sample_and_verify
from engine.runner.step_inputs import (
    StepInputs,
    lora_rows,
    uniform_verify_rows,
    verify_graph_min_fill,
)
from engine.runner.tp_driver import TensorParallelDriver
from engine.runner.tp_step import broadcast_step, step_header
from engine.sampler import Sampler, depends_on_outputs
from engine.scheduler import SampledToken, SchedulerOutput

logger = logging.getLogger(__name__)


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


class ModelRunner:
    """One engine's model on its device (with tensor parallelism: rank 0's shard, the driver
    running the others), its KV cache, its CUDA graphs, and each step from scheduled requests
    to sampled tokens."""

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
        if self.device.type == "cpu":
            set_cpu_threads(config.runner.cpu_threads)
        self.dtype = resolve_dtype(config.load.dtype, default_dtype, self.device)
        try:
            self.kv_dtype = kv_storage_dtype(config.cache.kv_cache_dtype, self.dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None
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
        self.kv = KVMemory(config, model_config, self.shard_config, self.device, self.dtype,
                           self.kv_dtype, max_model_len, self.model, self.run_model, self.tp,
                           calibrate_factors=not qk_dot_on_int8(self.device, self.backend.name,
                                                                model_config.head_dim))
        self.blocks = BlockIO(self.kv, self.device, self.step_stream, self.tp, self.shard.size)
        self.inputs = StepInputs(self.block_size, self.device)
        self.kv.set_up(kv_calibration_ids)
        if self.device.type == "cuda" and use_triton:
            from engine.attention.warmup import warm_up_attention

            scales = self.kv_scale_values[0] if self.kv_scale_values is not None else (None, None)
            n = warm_up_attention(self.kv_caches[0], self.shard_config.num_attention_heads,
                                  self.dtype, config.scheduler.max_num_batched_tokens, *scales)
            logger.info("attention kernels warmed up: %d variants", n)
        self.graphs: CudaGraphRunner | None = None
        self.lora_graphs: CudaGraphRunner | None = None  # decode steps with LoRA adapter rows
        self.verify_graphs: CudaGraphRunner | None = None
        # Whether requests may speculate (decides which steps must finish before the next).
        self.speculative = config.speculative.enabled and config.scheduler.role != "prefill"
        # Rows per sequence of a verify step laid out for the verify graphs (0: ragged, eager).
        self.verify_q_len = 0
        self.num_uniform_verify_steps = 0
        self.verify_graph_min_fill = verify_graph_min_fill()
        # Other steps of up to `piecewise_graph_max_tokens` tokens: layers from graphs,
        # attention eager (engine/piecewise_graphs.py).
        self.piecewise: PiecewiseGraphRunner | None = None
        self.capture_stream: torch.cuda.Stream | None = None
        if (captures_cuda_graphs(self.device, config.runner.enforce_eager, self.backend)
                and self.tp is None):
            captured = capture_graphs(self, config, self.speculative)
            self.capture_stream = captured.stream
            self.piecewise = captured.piecewise
            self.verify_q_len, self.verify_graphs = captured.verify_q_len, captured.verify
            self.lora_graphs = captured.lora
            self.graphs = captured.decode
        self.result = RunnerResult(str(self.device), self.dtype, self.kv.num_blocks, self.kv_dtype,
                                   self.block_bytes, self.backend.name, self.graphs is not None)

    # ---- the KV cache (engine/runner/kv_memory.py) -----------------------------------------

    @property
    def kv_cache(self) -> torch.Tensor:
        """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] of this rank."""
        return self.kv.cache

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """`kv_cache` per layer."""
        return self.kv.caches

    @property
    def kv_scales(self) -> torch.Tensor:
        """[num_layers, 2] float32 on the CPU: (K, V) scale per layer; the wire sends these."""
        return self.kv.scales

    @property
    def kv_scale_values(self) -> list[tuple[float, float]] | None:
        """`kv_scales` as floats for the forward context (None: unquantized cache)."""
        return self.kv.scale_values

    @property
    def kv_channel_factors(self) -> torch.Tensor | None:
        """An int8 cache's `[num_layers, 2, num_kv_heads, head_dim]` channel factors within each
        layer's scales (engine/attention/kv_channels.py); None: one scale per layer."""
        return self.kv.channel_factors

    @property
    def kv_calibration_tokens(self) -> int:
        """The calibration prefill's length (0: not calibrated)."""
        return self.kv.calibration_tokens

    @property
    def block_bytes(self) -> int:
        """A block as this rank holds it (its KV heads)."""
        return self.kv.block_bytes

    @property
    def kv_shape_per_block(self) -> tuple[int, int, int, int, int]:
        """A block as it leaves the engine (transfer, tiers): every KV head, whatever the split."""
        return self.kv.shape_per_block

    @property
    def kv_is_quantized(self) -> bool:
        """True for a 1-byte (fp8 or int8) cache, whose blocks travel with `kv_scales`."""
        return self.kv.is_quantized

    def measure_kv_amax(self, token_ids: list[int]) -> torch.Tensor:
        """`KVMemory.measure_amax`: each channel's largest |K| and |V| over one prefill,
        `[L, 2, Hkv, D]`."""
        return self.kv.measure_amax(token_ids)

    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """`KVMemory.prefill_logits`: every position's logits over a scratch cache like ours."""
        return self.kv.prefill_logits(token_ids)

    # ---- one step --------------------------------------------------------------------------

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

    def prepare(self, out: SchedulerOutput, uniform_q: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's (input ids, positions, metadata, logit rows) on the device
        (`StepInputs.prepare`)."""
        return self.inputs.prepare(out, self.max_model_len, uniform_q)

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
        uniform_q = uniform_verify_rows(out, self.verify_q_len, self.verify_graphs,
                                        self.max_model_len, self.verify_graph_min_fill)
        self.num_uniform_verify_steps += bool(uniform_q)
        out.padded_rows = uniform_q * len(out.scheduled)
        input_ids, positions, md, logit_rows = self.prepare(out, uniform_q)
        sampling_reqs = [s.request for s in out.scheduled if s.sample]
        # (A uniform verify step holds no prompt rows: every request in it is decoding. Nor
        # embedding requests, which sample nothing: no step with them replays a graph.)
        prompt_rows = (plan_prompt_rows(out.scheduled) if out.scores_prompt and not uniform_q
                       else [])
        prompt: PendingPromptLogprobs | None = None
        pool_plans = plan_pool_rows(out.scheduled) if out.pools else []
        pooled: PendingPooling | None = None
        lora = lora_rows(self.lora, out, md, self.device)
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
            pending = sample_and_verify(self.sampler, logits, out, prompt)
            if pending.tokens is not None:
                self.inputs.last_tokens = pending.tokens.tokens
            self.inputs.last_rows = {}  # no later step gathers a verify step's tokens
        else:
            tokens = self.sampler.sample(logits, sampling_reqs, keep_probs)
            self.inputs.last_tokens = tokens.tokens
            self.inputs.last_rows = {r.request_id: i for i, r in enumerate(sampling_reqs)}
            pending = PendingStep(tokens, speculative=self.speculative, prompt=prompt)
        pending.pooled = pooled
        return pending

    def overlaps(self, num_decodes: int) -> bool:
        """Whether a pure-decode batch this large runs as two overlapped micro-batches."""
        return 0 < self.decode_overlap_min_batch <= num_decodes

    def forward_overlapped(self, input_ids: torch.Tensor, positions: torch.Tensor,
                           md: AttentionMetadata) -> torch.Tensor:
        """The model over a pure-decode batch as two micro-batches (inside a forward context)."""
        assert self.micro_batches is not None
        halves = split_decode_metadata(md, input_ids.shape[0] // 2)
        return self.model.forward_overlapped(input_ids, positions, halves, self.micro_batches)

    @torch.inference_mode()
    def logits_for(self, out: SchedulerOutput) -> torch.Tensor:
        """Forward one scheduled step and return the logits of every token (tests/oracles)."""
        input_ids, positions, md, _ = self.prepare(out)
        with forward_context(ForwardContext(md, self.kv_caches, self.kv_scale_values,
                                            lora_rows(self.lora, out, md, self.device))):
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
        self.inputs.last_tokens = None
        self.kv.release()
        self.model.to("meta")  # parameters and buffers lose their storage
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- KV blocks for transfer (engine/runner/block_io.py) --------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """→ CPU tensor [n, num_layers, 2, block_size, Hkv, D] in the cache dtype (a copy; fp8 and
        int8 blocks are the stored values: multiply by `kv_scales` [L, 2] to get K/V)."""
        return self.blocks.read_blocks(block_ids)

    def read_leased_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """`read_blocks` for blocks no kernel writes while they are read (a leased prompt)."""
        return self.blocks.read_leased_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor,
                     scales: torch.Tensor | None = None) -> None:
        """blocks: [n, num_layers, 2, block_size, Hkv, D] → kv_cache at block_ids (scales: those
        of 1-byte blocks; None = ours). Returns when the blocks are in the cache."""
        self.blocks.write_blocks(block_ids, blocks, scales)

    def copy_blocks_from(self, block_ids: list[int], src_cache: torch.Tensor,
                         src_block_ids: list[int]) -> None:
        """Blocks `src_block_ids` of another cache of this layout → our `block_ids`."""
        self.blocks.copy_blocks_from(block_ids, src_cache, src_block_ids)

    def fence_kv_loads(self) -> None:
        """After a schedule handed out blocks for KV loads, before its step is launched."""
        self.blocks.fence_kv_loads()
