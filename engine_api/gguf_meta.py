"""GGUF metadata (torch-free): open a file safely and map its keys to HF config/tokenizer terms.

The tokenizer and the weight loader both read GGUF metadata; this module is the one place that
knows llama.cpp's key names.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import gguf
import numpy as np
import numpy.typing as npt

from engine_api.errors import ModelLoadError

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM"}
# What llama.cpp's Gemma 3 reader takes as fixed rather than from the file (llama-model.cpp):
# every 6th layer global, the local layers' RoPE base 10k, no final logit soft cap.
_GEMMA3_FIXED = {"hidden_activation": "gelu_pytorch_tanh", "rope_local_base_freq": 10_000.0,
                 "sliding_window_pattern": 6, "final_logit_softcapping": None}
_GEMMA3_27B_LAYERS = 62


class _PlainViewReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose metadata parts and tensor arrays are plain ndarray views of the
    file's memmap (it stays open through their `.base`) instead of `np.memmap` slices.

    The stock reader takes one memmap slice per scalar it parses, and every `np.memmap` slice
    runs Python-level `__getitem__`/`__array_finalize__`: a vocabulary of 49k strings is ~0.5M
    slices, 2.8 s to open SmolLM2's GGUF on a 2-core machine against 0.7 s for the same
    values through plain views (the weights' dequantization slices them again). The fields and
    tensors are equal to the stock reader's (tests/unit/engine/test_loader.py compares them)."""

    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: Literal["I", "S", "<"] | None = None) -> npt.NDArray[Any]:
        plain: np.ndarray | None = self.__dict__.get("_plain")
        if plain is None:  # `self.data` is the memmap the base class opened first
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's metadata as Python values (arrays as tuples) and its tensors' names: what
    the tokenizer and the config read, without the file's memmap."""

    values: Mapping[str, Any]
    tensor_names: frozenset[str]
    # Where the tensor infos start, after the fields (None: no tensors).
    tensor_info_offset: int | None


# Files' metadata by identity (path, inode, size, mtime): a process that loads a model reads its
# GGUF metadata for the tokenizer, the config and again in every later load (each worker of an
# in-process stack, a gateway's tokenizer); parsing SmolLM2's (49k tokens, 48k merges) takes ~1 s
# of a 2-core machine's time each. A changed file is a new key.
_METADATA: OrderedDict[tuple[str, int, int, int], GGUFMetadata] = OrderedDict()
_METADATA_FILES = 4
_METADATA_LOCK = threading.Lock()


def read_metadata(path: str) -> GGUFMetadata:
    """The metadata of GGUF file `path` (validated as `open_gguf` does), read once per version
    of the file in this process."""
    try:
        st = os.stat(path)
    except OSError:
        raise ModelLoadError(f"GGUF file not found: {path}") from None
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _METADATA_LOCK:
        hit = _METADATA.get(key)
        if hit is not None:
            _METADATA.move_to_end(key)
            return hit
    reader = open_gguf(path)
    meta = GGUFMetadata(
        values=MappingProxyType({k: _frozen(f.contents()) for k, f in reader.fields.items()}),
        tensor_names=frozenset(t.name for t in reader.tensors),
        tensor_info_offset=int(reader.tensors[0].field.offset) if reader.tensors else None)
    with _METADATA_LOCK:
        _METADATA[key] = meta
        while len(_METADATA) > _METADATA_FILES:
            _METADATA.popitem(last=False)
    return meta


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


class _TensorsReader(_PlainViewReader):
    """A reader of the tensors alone: it skips the metadata fields, to where `read_metadata`
    found the tensor infos of this very version of the file (walking 49k token strings again
    for each stream of weights is the second of SmolLM2's load that this saves). Its `fields`
    hold `general.alignment` only, the one field the tensors' layout depends on."""

    def __init__(self, path: str, skip: GGUFMetadata) -> None:
        self._skip = skip
        super().__init__(path, "r")

    def _build_fields(self, offs: int, count: int) -> int:
        alignment = self._skip.values.get("general.alignment")
        if alignment is not None:
            self._push_field(gguf.ReaderField(offs, "general.alignment",
                                              [np.array([alignment], dtype=np.uint32)], [0],
                                              [gguf.GGUFValueType.UINT32]))
        assert self._skip.tensor_info_offset is not None
        return self._skip.tensor_info_offset


def open_gguf(path: str, metadata: GGUFMetadata | None = None) -> gguf.GGUFReader:
    """Open and validate a GGUF file: header, metadata, and every tensor's extent in the file.
    With `metadata` (`read_metadata`'s for this file), the metadata fields are skipped: the
    reader has the tensors alone.

    Raises ModelLoadError naming `path` for a missing, truncated or corrupt file, so nothing
    fails later while streaming tensors.
    """
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = (_TensorsReader(path, metadata)
                  if metadata is not None and metadata.tensor_info_offset is not None
                  else _PlainViewReader(path, "r"))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad bytes
        raise ModelLoadError(f"{path}: not a valid GGUF file (corrupt or truncated): {e}") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to {end}, "
                f"file has {size}")
    return reader


def field_value(meta: GGUFMetadata, key: str, default: Any = None) -> Any:
    """The Python value of metadata `key` (str, int, float, bool or tuple), or `default`."""
    return meta.values.get(key, default)


def architecture(meta: GGUFMetadata, path: str) -> str:
    """llama.cpp's `general.architecture`, checked against the supported ones."""
    from engine_api.errors import ConfigError

    arch = field_value(meta, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        # Gemma 2 (soft caps) and Gemma 3n (its own decoder) are not mapped from GGUF: name
        # the way that works.
        hint = "; load Gemma from its Hugging Face directory" if str(arch).startswith(
            "gemma") else ""
        raise ConfigError(
            f"{path}: GGUF general.architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}{hint}")
    return str(arch)


def _rope_scaling(meta: GGUFMetadata, arch: str) -> dict[str, Any] | None:
    kind = field_value(meta, f"{arch}.rope.scaling.type")
    factor = field_value(meta, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(factor)}
    orig = field_value(meta, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def hf_config_dict(meta: GGUFMetadata, path: str) -> dict[str, Any]:
    """An HF `config.json`-style dict built from the file's llama.cpp metadata."""
    arch = architecture(meta, path)

    def need(key: str) -> Any:
        value = field_value(meta, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    n_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(field_value(meta, f"{arch}.attention.key_length", hidden // n_heads))
    rotated = field_value(meta, f"{arch}.rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:  # Phi-4-mini rotates 3/4 of each head
        raise ModelLoadError(f"{path}: GGUF {arch}.rope.dimension_count {rotated} of a head "
                             f"dimension of {head_dim}: partial rotary is not supported")
    experts = field_value(meta, f"{arch}.expert_count")
    if experts:  # Mixtral as llama.cpp writes it: ffn_*_exps tensors, not read here
        raise ModelLoadError(f"{path}: GGUF {arch}.expert_count {experts}: mixture-of-experts "
                             "GGUF files are not supported; load the model's Hugging Face "
                             "directory (safetensors) instead")
    window = field_value(meta, f"{arch}.attention.sliding_window")
    tokens = field_value(meta, "tokenizer.ggml.tokens")
    vocab = field_value(meta, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    names = meta.tensor_names
    eos = [field_value(meta, k) for k in ("tokenizer.ggml.eos_token_id",
                                            "tokenizer.ggml.eot_token_id")]
    d: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab) if vocab is not None else None,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(field_value(meta, f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field_value(meta, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": int(need("context_length")),
        "sliding_window": int(window) if window else None,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field_value(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted({int(e) for e in eos if e is not None}),
    }
    if arch == "gemma3":
        # The attention scale llama.cpp uses: 1/sqrt(head_dim), 27B's 1/sqrt(hidden / heads).
        scalar = (hidden // n_heads if d["num_hidden_layers"] == _GEMMA3_27B_LAYERS
                  else head_dim)
        d.update(_GEMMA3_FIXED, query_pre_attn_scalar=scalar)
    return d
