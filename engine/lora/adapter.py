"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`), read
and checked against the base model it is to run on.

PEFT's semantics: a targeted projection computes `W x + scaling · B (A x)` with `A [r, in]`,
`B [out, r]` and `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA). What this
engine does not implement is refused by name — DoRA, trained biases, modules saved whole,
per-module ranks, embedding or LM-head adapters — rather than served approximately.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from engine.config import ConfigError, ModelConfig
from engine.loader.load import weights_id
from engine.loader.safetensors_check import read_header

# The projections an adapter may target (Hugging Face names) and where each sits.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS

_NAME = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                   r"\.lora_([AB])(?:\.default)?\.weight$")
# An adapter file larger than this is refused before it is read (a rank-64 adapter of every
# projection of a 70B model is ~1.7 GB in bf16).
MAX_ADAPTER_BYTES = 4 << 30


class LoRAError(ConfigError):
    """An adapter that cannot run on this model; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    weights_id: str  # the files' identity (path, size, mtime): part of its KV cache identity
    # (layer, target) -> (A [r, in], B [out, r]), float32 on the CPU.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> set[str]:
        return {t for _, t in self.weights}


def target_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) features of projection `target` in the base model."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv),
            "v_proj": (cfg.hidden_size, kv), "o_proj": (q, cfg.hidden_size),
            "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
            "up_proj": (cfg.hidden_size, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size)}[target]


def _read_config(path: str) -> dict[str, object]:
    file = os.path.join(path, "adapter_config.json")
    try:
        with open(file, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{path}: no adapter_config.json (a PEFT LoRA adapter directory is "
                        "expected)") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"{file}: {e}") from None
    if not isinstance(d, dict):
        raise LoRAError(f"{file}: expected a JSON object")
    return d


def _check_config(file: str, d: dict[str, object], max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from a PEFT config; LoRAError for what is not implemented."""
    if d.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{file}: peft_type {d.get('peft_type')!r} is not LoRA")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights"}
    for key, what in refused.items():
        if d.get(key):
            raise LoRAError(f"{file}: {what} ({key}) is not supported")
    if d.get("bias", "none") != "none":
        raise LoRAError(f"{file}: trained biases (bias={d.get('bias')!r}) are not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if d.get(key):
            raise LoRAError(f"{file}: {key} is not supported")
    r, alpha = d.get("r"), d.get("lora_alpha", d.get("r"))
    if type(r) is not int or not 1 <= r <= max_rank:
        raise LoRAError(f"{file}: rank r={r!r} must be an integer in [1, {max_rank}] "
                        "(raise --max-lora-rank for larger adapters)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAError(f"{file}: lora_alpha={alpha!r} must be a positive number")
    scaling = alpha / math.sqrt(r) if d.get("use_rslora") else alpha / r
    return r, float(scaling)


def _weights_file(path: str) -> str:
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise LoRAError(f"{path}: adapter_model.bin is a pickle; only "
                            "adapter_model.safetensors is read")
        raise LoRAError(f"{path}: no adapter_model.safetensors")
    if os.path.getsize(file) > MAX_ADAPTER_BYTES:
        raise LoRAError(f"{file}: larger than {MAX_ADAPTER_BYTES >> 30} GiB")
    return file


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read adapter `name` from directory `path` and check every tensor against `cfg`."""
    config_file = os.path.join(path, "adapter_config.json")
    rank, scaling = _check_config(config_file, _read_config(path), max_rank)
    file = _weights_file(path)
    try:
        names = list(read_header(file))  # validated offsets before anything is mapped
    except (OSError, ValueError) as e:
        raise LoRAError(f"{file}: {e}") from None
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(file, framework="pt") as f:
        for tensor_name in names:
            if tensor_name == "__metadata__":
                continue
            m = _NAME.match(tensor_name)
            if m is None:
                raise LoRAError(f"{file}: tensor {tensor_name!r} is not a LoRA A/B weight of a "
                                f"decoder layer's projection (supported: {', '.join(TARGETS)})")
            layer, block, target, half = int(m[1]), m[2], m[3], m[4]
            if target not in TARGETS or (block == "mlp") != (target in MLP_TARGETS):
                raise LoRAError(f"{file}: {tensor_name!r} targets {block}.{target}; supported: "
                                f"{', '.join(TARGETS)}")
            if not 0 <= layer < cfg.num_hidden_layers:
                raise LoRAError(f"{file}: {tensor_name!r} names layer {layer}; the model has "
                                f"{cfg.num_hidden_layers}")
            if block == "mlp" and cfg.is_sparse_layer(layer):
                raise LoRAError(f"{file}: {tensor_name!r}: layer {layer}'s MLP is a mixture of "
                                "experts; adapters on experts are not supported (attention "
                                "projections are)")
            tensor = f.get_tensor(tensor_name).float()
            if not bool(torch.isfinite(tensor).all()):
                # Every row of a step multiplies every adapter's columns (masked by zero after):
                # an inf or NaN here would turn other requests' outputs into NaN too.
                raise LoRAError(f"{file}: {tensor_name!r} holds inf or NaN values")
            halves[(layer, target, half)] = tensor
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target, half), tensor in halves.items():
        if half == "B":
            continue
        b = halves.get((layer, target, "B"))
        if b is None:
            raise LoRAError(f"{file}: layer {layer} {target} has lora_A without lora_B")
        n_in, n_out = target_shape(cfg, target)
        if tuple(tensor.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise LoRAError(f"{file}: layer {layer} {target}: A {tuple(tensor.shape)} and B "
                            f"{tuple(b.shape)} do not fit the model's ({n_out} x {n_in}) "
                            f"projection at rank {rank}")
        weights[(layer, target)] = (tensor, b)
    if len(weights) * 2 != len(halves):
        raise LoRAError(f"{file}: a lora_B without its lora_A")
    if not weights:
        raise LoRAError(f"{file}: holds no LoRA weights")
    return LoRAAdapter(name, path, rank, scaling, weights_id(path), weights)
