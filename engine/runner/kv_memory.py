"""This rank's paged KV cache: its scales (a quantized cache), its size and its allocation, and
the one-off prefills over scratch caches that calibrate and size it.

The cache is a single tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
so that a block (`cache[:, :, block_id]`) can be read or written in one copy for transfer.
With `kv_cache_dtype="fp8"` it is float8_e4m3fn holding K/V divided by per-layer scales
(`scales [num_layers, 2]` float32, 1.0 without calibration), with "int8" int8 under scales
calibrated at start-up or read from a file (engine/attention/kv_quant.py, kv_calibration.py),
and per-channel factors within each layer (`channel_factors [num_layers, 2, num_kv_heads,
head_dim]`, engine/attention/kv_channels.py), which the attention layers apply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from engine.attention.forward_context import AttentionMetadata, ForwardContext, forward_context
from engine.attention.kv_calibration import calibration_token_ids, load_kv_scales, round_scales
from engine.attention.kv_channels import channel_factors, install, layer_amax
from engine.attention.kv_quant import default_kv_scales, scales_from_amax
from engine.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from engine.kernels._checks import is_quantized_kv
from engine.model.llama import LlamaForCausalLM
from engine.parallel.protocol import Cache, Op
from engine.runner.kv_sizing import cpu_kv_blocks, gpu_kv_blocks, weight_bytes
from engine.runner.tp_driver import TensorParallelDriver

logger = logging.getLogger(__name__)


class RunModel(Protocol):
    """The model's forward pass over this rank and, with tensor parallelism, the workers'
    (`ModelRunner.run_model`), inside a forward context the caller set."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                 cache: Cache = Cache.ENGINE, scratch_blocks: int = 0) -> torch.Tensor: ...


class KVMemory:
    """The KV cache of one model runner (its rank's KV heads of every block).

    `set_up` decides the scales and the number of blocks (on every rank) and allocates the
    cache; until then `cache` is empty. `run_model` is passed in, not imported: the runner
    that owns this object is the one that runs the model."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, shard_config: ModelConfig,
                 device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 max_model_len: int, model: LlamaForCausalLM, run_model: RunModel,
                 tp: TensorParallelDriver | None, calibrate_factors: bool = True) -> None:
        """model_config: the whole model's; shard_config: this rank's share of it.
        calibrate_factors: whether an int8 cache's calibration gives channel factors (not where
        the decode kernel's QK dot rounds q to int8: `kv_channels.qk_dot_on_int8`)."""
        self.config = config
        self.model_config = model_config
        self.shard_config = shard_config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.max_model_len = max_model_len
        self.model = model
        self.run_model = run_model
        self.tp = tp
        self.calibrate_factors = calibrate_factors
        self.block_size = config.cache.block_size
        full, cfg = model_config, shard_config
        # A block as it leaves the engine (transfer, tiers): every KV head, whatever the split.
        self.shape_per_block = (full.num_hidden_layers, 2, self.block_size,
                                full.num_key_value_heads, full.head_dim)
        # A block as this rank holds it (its KV heads): what its memory is sized by.
        self.block_bytes = (2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads
                            * cfg.head_dim * kv_dtype.itemsize)
        # [num_layers, 2] float32 on the CPU: (K, V) scale per layer; the wire sends these.
        # Calibrated ones are set by `set_up`, once the model can run.
        self.scales = default_kv_scales(model_config.num_hidden_layers)
        # The same as floats for the forward context (None: unquantized cache).
        self.scale_values: list[tuple[float, float]] | None = None
        # An int8 cache's per-channel factors [L, 2, Hkv, D] (every KV head; None: one scale per
        # layer, as fp8 and a per-layer scales file have); part of the model fingerprint.
        self.channel_factors: torch.Tensor | None = None
        self.calibration_tokens = 0  # the calibration prefill's length (0: not calibrated)
        self.num_blocks = 0
        self.cache = torch.empty(0, dtype=kv_dtype, device=device)
        self.caches: list[torch.Tensor] = []  # `cache` per layer

    @property
    def is_quantized(self) -> bool:
        """True for a 1-byte (fp8 or int8) cache, whose blocks travel with `scales`."""
        return self.kv_dtype.itemsize == 1

    @property
    def local_block_shape(self) -> tuple[int, int, int]:
        """(block_size, KV heads, head_dim) of a block of this rank's cache."""
        cfg = self.shard_config
        return (self.block_size, cfg.num_key_value_heads, cfg.head_dim)

    def set_up(self, calibration_ids: Callable[[], list[int]] | None) -> None:
        """Scales (a quantized cache), size and allocation of the KV cache, on every rank.
        calibration_ids: the prompt a quantized cache's scales are calibrated on (called only
        when they are; default: pseudo-random ids from a fixed seed)."""
        cfg = self.shard_config
        if is_quantized_kv(self.kv_dtype):
            self.scales, self.channel_factors = self._scales_for(self.config.cache,
                                                                 calibration_ids)
            self.scale_values = [(k, v) for k, v in self.scales.tolist()]
            rank, size = (0, 1) if self.tp is None else (0, self.tp.size)
            install(self.model.attention_layers(), self.channel_factors,
                    rank, size, self.device, self.dtype)
            if self.tp is not None:
                self.tp.set_kv_scales(self.scales, self.channel_factors)
        num_blocks = self._num_blocks()
        if self.tp is not None:
            num_blocks = self.tp.capacity(num_blocks)
            self.tp.allocate_kv(num_blocks)
        self.cache = torch.zeros(cfg.num_hidden_layers, 2, num_blocks, self.block_size,
                                 cfg.num_key_value_heads, cfg.head_dim,
                                 dtype=self.kv_dtype, device=self.device)
        self.caches = list(self.cache.unbind(0))
        self.num_blocks = num_blocks

    def release(self) -> None:
        """Drop the cache's memory (the runner is being released)."""
        self.caches = []
        self.cache = self.cache.new_empty(0)

    # ---- quantized KV scales ---------------------------------------------------------------

    def _scales_for(self, cache: CacheConfig,
                    calibration_ids: Callable[[], list[int]] | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[L, 2]` scales of a quantized cache and, for int8, its `[L, 2, Hkv, D]` channel
        factors: from the file `cache.kv_scales` names, from a calibration pass ("calibrate";
        int8's default), or 1.0 and none (fp8's default)."""
        full = self.model_config
        layers = full.num_hidden_layers
        source = cache.kv_scales
        int8 = self.kv_dtype == torch.int8
        if source is None:
            source = "calibrate" if int8 else None
        if source is None:
            return default_kv_scales(layers), None
        if source != "calibrate":
            scales, factors = load_kv_scales(source, layers, full.num_key_value_heads,
                                             full.head_dim)
            if factors is not None and not int8:
                logger.info("KV cache scales from %s: its channel factors are for int8 caches; "
                            "this %s cache keeps one scale per layer", source, self.kv_dtype)
                factors = None
            logger.info("KV cache scales from %s (%s)", source,
                        "per channel" if factors is not None else "per layer")
            return scales, factors
        if calibration_ids is not None:
            ids = calibration_ids()
        else:
            ids = calibration_token_ids(None, full.vocab_size)
        ids = ids[:max(1, self.max_model_len)]
        amax = self.measure_amax(ids)
        self.calibration_tokens = len(ids)
        scales = round_scales(scales_from_amax(layer_amax(amax), self.kv_dtype))
        factors = channel_factors(amax) if int8 and self.calibrate_factors else None
        logger.info("KV cache scales calibrated on %d tokens: K %.4g..%.4g, V %.4g..%.4g%s",
                    len(ids), scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(),
                    scales[:, 1].max(), "" if factors is None else
                    f"; channel factors K {factors[:, 0].min():.3g}..{factors[:, 0].max():.3g}, "
                    f"V {factors[:, 1].min():.3g}..{factors[:, 1].max():.3g}")
        return scales, factors

    @torch.inference_mode()
    def measure_amax(self, token_ids: list[int]) -> torch.Tensor:
        """One prefill of `token_ids` with a float cache → each channel's largest |K| (as cached:
        after RoPE) and |V|, `[L, 2, Hkv, D]` float32 on the CPU, over every KV head (with
        tensor parallelism the ranks' heads gathered in rank order)."""
        _, scratch = self._scratch_prefill(token_ids, self.dtype, None, Cache.SCRATCH_FLOAT)
        amax = scratch.abs().amax(dim=(2, 3)).float()  # [L, 2, Hkv (this rank's), D]
        if self.tp is not None:
            import torch.distributed as dist
            parts = [torch.empty_like(amax) for _ in range(self.tp.size)]
            with self.tp.command(Op.KV_AMAX):
                dist.all_gather(parts, amax.contiguous())
            amax = torch.cat(parts, dim=2)
        amax = amax.cpu()
        if not bool(torch.isfinite(amax).all()):
            raise ConfigError("the KV calibration pass produced non-finite K/V; the model's "
                              "activations overflow its dtype")
        return amax

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits `[n, vocab]` (float32, CPU) of every position of one prefill of `token_ids`
        over a scratch cache of this cache's dtype and scales: every position reads its own
        and earlier K/V back from the cache, as decoding does (accuracy probes)."""
        hidden, _ = self._scratch_prefill(token_ids, self.kv_dtype, self.scale_values,
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
                              *self.local_block_shape, dtype=kv_dtype, device=self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        md = self._profile_metadata(n)
        with forward_context(ForwardContext(md, list(scratch.unbind(0)), scales)):
            hidden = self.run_model(ids, pos, md, cache, blocks)
        return hidden, scratch

    # ---- sizing ----------------------------------------------------------------------------

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if self.device.type != "cuda":
            return cpu_kv_blocks(self.config, self.block_bytes, self.max_model_len,
                                 weight_bytes(self.model))
        return self._profile_gpu_blocks()

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
                              *self.local_block_shape, dtype=self.kv_dtype, device=self.device)
        md = self._profile_metadata(n)
        with forward_context(ForwardContext(md, list(scratch.unbind(0)), self.scale_values)):
            h = self.run_model(ids, pos, md, Cache.PROFILE, blocks)
            self.model.compute_logits(h[-min(n, self.config.scheduler.max_num_seqs):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del scratch, h
        torch.cuda.empty_cache()
        return gpu_kv_blocks(self.config, self.device, peak, self.block_bytes,
                             self.model.lm_head_weight.shape[0])

    def _profile_metadata(self, n: int) -> AttentionMetadata:
        """One sequence of `n` prompt tokens over blocks 0.. of a scratch cache."""
        nb = -(-n // self.block_size)
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
            slot_mapping=torch.arange(n, dtype=torch.long, device=dev),
            num_decodes=0, max_query_len=n, max_seq_len=n,
            query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
