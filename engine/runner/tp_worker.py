"""A tensor-parallel worker: rank r > 0's process. It holds its share of the model and of the
KV cache (its KV heads of every block; block ids are rank 0's) and serves rank 0's commands
(engine/parallel/protocol.py) one at a time, entering the same collectives in the same order.
It samples nothing and schedules nothing: rank 0 does both.
"""

from __future__ import annotations

import json
import logging
import os
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.parallel.protocol import WorkerSpec
from engine.runner.cpu_threads import set_cpu_threads

logger = logging.getLogger(__name__)


def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """The worker process's entry point: load the shard, report "ok" (or the error), serve."""
    try:
        worker = ShardWorker(spec)
    except BaseException as e:  # reported to rank 0, which raises it as a ConfigError
        try:
            conn.send_bytes(f"{type(e).__name__}: {e}"[:4096].encode())
        finally:
            conn.close()
        return
    conn.send_bytes(b"ok")
    try:
        worker.serve(conn)
    finally:
        worker.close()
        conn.close()


class ShardWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        from engine.attention.kv_quant import kv_storage_dtype
        from engine.loader import load_model_source
        from engine.parallel.group import init_group, joined_key, rendezvous
        from engine.parallel.shard import TensorShard
        from engine.runner.model_build import (
            TORCH_DTYPES,
            build_lora,
            build_model,
            make_attention_backend,
        )

        config = spec.config
        self.config = config
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            set_cpu_threads(config.runner.cpu_threads)
        timeout_s = config.parallel.collective_timeout_s
        store = rendezvous(spec.rank, spec.size, spec.port, timeout_s)
        store.set(joined_key(spec.rank), "1")
        init_group(self, spec.rank, spec.size, store, self.device, timeout_s)
        source = load_model_source(config.load)
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.kv_dtype = kv_storage_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.backend = make_attention_backend(config.runner.attention_backend, self.device)
        self.shard = TensorShard(spec.rank, spec.size)
        self.max_model_len = spec.max_model_len
        self.model = build_model(config, source.config, self.shard, self.device, self.dtype,
                                 self.backend, spec.max_model_len, source.weights,
                                 source.dummy_seed)
        # LoRA adapters: this rank's share of each (the rows' slots come with each step).
        self.lora = build_lora(config, source.config, self.device, self.dtype, self.shard,
                               self.backend.name == "triton")
        self.model_config = source.config  # the whole model's (adapters are checked against it)
        self._conn: Connection | None = None  # rank 0's pipe, while serving
        cfg = self.model.config
        self.block_shape = (config.cache.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.num_layers = cfg.num_hidden_layers
        self.block_bytes = (2 * cfg.num_hidden_layers * config.cache.block_size
                            * cfg.num_key_value_heads * cfg.head_dim * self.kv_dtype.itemsize)
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scale_values: list[tuple[float, float]] | None = None
        self._amax: torch.Tensor | None = None  # the last calibration pass's maxima
        self._peak = 0  # the last profiling pass's peak device memory

    def close(self) -> None:
        from engine.parallel.group import destroy_group
        self.kv_cache = None
        self.kv_caches = []
        destroy_group(self)

    # ---- the command loop ------------------------------------------------------------------

    def serve(self, conn: Connection) -> None:
        from engine.parallel.protocol import Op, unpack

        handlers = {Op.FORWARD: self._forward, Op.KV_CAPACITY: self._capacity,
                    Op.ALLOCATE_KV: self._allocate, Op.SET_KV_SCALES: self._set_scales,
                    Op.KV_AMAX: self._reduce_amax, Op.READ_BLOCKS: self._read_blocks,
                    Op.WRITE_BLOCKS: self._write_blocks, Op.LORA_ADD: self._lora_add,
                    Op.LORA_REMOVE: self._lora_remove}
        self._conn = conn
        while True:
            try:
                data = conn.recv_bytes(256)
            except (EOFError, OSError):
                logger.info("rank %d: rank 0 is gone; exiting", self.shard.rank)
                return
            op, fields = unpack(data)
            if op is Op.SHUTDOWN:
                return
            with torch.inference_mode():
                handlers[op](fields)

    def _payload(self, size: int) -> dict[str, str]:
        """A LoRA command's JSON payload, the next message on rank 0's pipe."""
        assert self._conn is not None
        data = json.loads(self._conn.recv_bytes(size))
        if not isinstance(data, dict):
            raise RuntimeError("a LoRA command's payload is not a JSON object")
        return data

    def _lora_add(self, fields: list[int]) -> None:
        """Load this rank's share of an adapter into the slot every rank picks (the first free
        one: the ranks' slots change together); undone when another rank failed."""
        from engine.lora import load_adapter

        d = self._payload(fields[0])
        ok = 0
        try:
            if self.lora is None:
                raise RuntimeError("no LoRA slots on this rank")
            self.lora.add(load_adapter(d["name"], d["path"], self.model_config,
                                       self.config.lora.max_lora_rank))
            ok = 1
        except Exception:
            logger.exception("rank %d: LoRA adapter %r not loaded", self.shard.rank, d["name"])
        flag = torch.tensor([ok], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if ok and not flag.item() and self.lora is not None:
            self.lora.remove(d["name"])

    def _lora_remove(self, fields: list[int]) -> None:
        d = self._payload(fields[0])
        if self.lora is not None and d["name"] in self.lora.slots:
            self.lora.remove(d["name"])

    def _forward(self, fields: list[int]) -> None:
        from engine.attention.forward_context import ForwardContext, forward_context
        from engine.lora import LoRABatch
        from engine.parallel.protocol import Cache, ForwardHeader
        from engine.runner.tp_step import receive_step

        h = ForwardHeader.from_fields(fields)
        ids, positions, md, slots = receive_step(h, self.device)
        if slots is not None and self.lora is None:
            raise RuntimeError("a step with LoRA rows on a rank without adapters")
        lora = None if slots is None or self.lora is None else (self.lora, LoRABatch(slots))
        scratch: torch.Tensor | None = None
        if h.cache is Cache.ENGINE:
            if self.kv_cache is None:
                raise RuntimeError("a forward pass over the KV cache before it was allocated")
            caches, scales = self.kv_caches, self.kv_scale_values
        else:
            if h.cache is Cache.PROFILE and self.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.device)
            dtype = self.dtype if h.cache is Cache.SCRATCH_FLOAT else self.kv_dtype
            scratch = torch.zeros(self.num_layers, 2, h.scratch_blocks, *self.block_shape,
                                  dtype=dtype, device=self.device)
            caches = list(scratch.unbind(0))
            scales = None if h.cache is Cache.SCRATCH_FLOAT else self.kv_scale_values
        with forward_context(ForwardContext(md, caches, scales, lora)):
            self.model(ids, positions)
        if h.cache is Cache.SCRATCH_FLOAT and scratch is not None:
            self._amax = scratch.abs().amax(dim=(2, 3)).float()  # [L, 2, Hkv (ours), D]
        if h.cache is Cache.PROFILE and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._peak = torch.cuda.max_memory_allocated(self.device)

    def _reduce_amax(self, fields: list[int]) -> None:
        if self._amax is None:
            raise RuntimeError("KV maxima asked for before a calibration pass")
        parts = [torch.empty_like(self._amax) for _ in range(self.shard.size)]
        dist.all_gather(parts, self._amax.contiguous())  # rank 0 lays them side by side
        self._amax = None

    def _capacity(self, fields: list[int]) -> None:
        from engine.runner.kv_sizing import cpu_kv_blocks, gpu_kv_blocks, weight_bytes

        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            n = cache.num_gpu_blocks
        elif self.device.type != "cuda":
            n = cpu_kv_blocks(self.config, self.block_bytes, self.max_model_len,
                              weight_bytes(self.model))
        else:
            torch.cuda.empty_cache()
            n = gpu_kv_blocks(self.config, self.device, self._peak, self.block_bytes,
                              self.model.lm_head_weight.shape[0])
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)

    def _allocate(self, fields: list[int]) -> None:
        num_blocks = fields[0]
        self.kv_cache = torch.zeros(self.num_layers, 2, num_blocks, *self.block_shape,
                                    dtype=self.kv_dtype, device=self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        if self.device.type == "cuda" and self.backend.name == "triton":
            from engine.attention.warmup import warm_up_attention
            scales = self.kv_scale_values[0] if self.kv_scale_values is not None else (None, None)
            warm_up_attention(self.kv_caches[0], self.model.config.num_attention_heads,
                              self.dtype, self.config.scheduler.max_num_batched_tokens, *scales)

    def _set_scales(self, fields: list[int]) -> None:
        from engine.attention.kv_channels import install

        layers, heads, head_dim = fields[0], fields[1], fields[2]
        t = torch.empty(layers, 2, dtype=torch.float32, device=self.device)
        dist.broadcast(t, src=0)
        self.kv_scale_values = [(k, v) for k, v in t.cpu().tolist()]
        factors = None
        if heads:  # the whole model's channel factors; this rank applies its heads' share
            factors = torch.empty(layers, 2, heads, head_dim, dtype=torch.float32,
                                  device=self.device)
            dist.broadcast(factors, src=0)
        install(self.model.attention_layers(), factors, self.shard.rank,
                self.shard.size, self.device, self.dtype)

    def _cache_bytes(self) -> torch.Tensor:
        assert self.kv_cache is not None
        return self.kv_cache.view(torch.uint8) if self.kv_dtype.itemsize == 1 else self.kv_cache

    def _block_ids(self, n: int) -> torch.Tensor:
        idx = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(idx, src=0)
        return idx

    def _read_blocks(self, fields: list[int]) -> None:
        idx = self._block_ids(fields[0])
        local = self._cache_bytes().index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
        dist.gather(local, None, dst=0)

    def _write_blocks(self, fields: list[int]) -> None:
        idx = self._block_ids(fields[0])
        cache = self._cache_bytes()
        mine = torch.empty((fields[0], self.num_layers, 2, *self.block_shape), dtype=cache.dtype,
                           device=self.device)
        dist.scatter(mine, None, src=0)
        cache.index_copy_(2, idx, mine.permute(1, 2, 0, 3, 4, 5))


if __name__ == "__main__":  # pragma: no cover - started by the driver through multiprocessing
    raise SystemExit(f"{os.path.basename(__file__)} is started by the engine, not by hand")
