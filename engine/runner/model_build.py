"""What a model runner is built from, on rank 0 and on every tensor-parallel worker alike: the
device and dtype, the attention backend, the model (its weights loaded and quantized) and the
LoRA adapters, and the configuration checks those depend on.
"""

from __future__ import annotations

import logging
import sys

import torch
from tqdm import tqdm

from engine.attention.backend import PagedAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.devices import indexed_device
from engine.lora import LoRAStack, load_adapter
from engine.model.layers import RotaryEmbedding
from engine.model.llama import LlamaForCausalLM
from engine.model.quant import apply_fp8_w8a8, apply_int8_weight_only, check_fp8_supported
from engine.parallel.shard import TensorShard, shard_model_config

logger = logging.getLogger(__name__)

# The `dtype` names a config (and a worker's start-up spec) may give, as torch dtypes.
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """The runner's device, a GPU always with its index (`indexed_device`)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return indexed_device(torch.device(name))


def resolve_dtype(name: str, default: torch.dtype, device: torch.device) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
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
        # A progress bar on stderr (rank 0 only: the other ranks load the same stream's shares).
        stream = tqdm(weights(), desc="Loading weights", unit=" tensors",  # type: ignore[operator]
                      disable=shard.rank != 0, file=sys.stderr)
        model.load_weights(stream)
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
