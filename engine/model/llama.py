"""Llama-family decoder over a paged KV cache: Llama 2/3/3.1, Mistral, Qwen2 (QKV bias), Qwen3
(RMSNorm over each head of q and k), Phi-3/Phi-4 (checkpoints already fused), SmolLM2, and
Gemma 2/3 (their decoder layer in `gemma.py`, Llama's in `decoder.py`; scaled embeddings,
soft-capped logits here).

Input is one flattened varlen batch (`input_ids: [T]`, `positions: [T]`); attention reads the
step's metadata and KV cache from the forward context. QKV and gate/up projections are fused;
`load_weights` takes Hugging Face names and fills the fused parameters.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from engine.attention.backend import PagedAttentionBackend
from engine.attention.forward_context import (
    AttentionMetadata,
)
from engine.config import ModelConfig
from engine.model.decoder import LlamaAttention, LlamaDecoderLayer
from engine.model.gemma import GemmaDecoderLayer
from engine.model.layers import (
    GemmaRMSNorm,
    RotaryEmbedding,
    make_norm,
)
from engine.model.overlap import MicroBatchStreams
from engine.parallel.shard import TensorShard, shard_weight


class MissingWeightsError(ValueError):
    """A checkpoint lacks parameters the model needs (names listed) or has unknown ones."""


# One expert's projection: layers.<i>.mlp.experts.<e>.<proj>.weight (after `canonical_name`).
_EXPERT_NAME = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)"
                          r"\.weight$")
# Mixtral's names for what Qwen3-MoE (and this model) call mlp, gate_proj, up_proj, down_proj.
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
                  (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def canonical_name(name: str) -> str:
    """A checkpoint's parameter name as this model spells it: Mixtral's sparse-MoE names
    become Qwen3-MoE's; every other name is unchanged."""
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name


def _expert_parts(param: str, num_experts: int) -> set[str]:
    """The per-expert checkpoint names a stacked expert parameter is loaded from."""
    prefix, stacked = param.rsplit(".", 1)
    projs = ("down_proj",) if stacked == "down_proj" else ("gate_proj", "up_proj")
    return {f"{prefix}.{e}.{p}.weight" for e in range(num_experts) for p in projs}


def _copy_checked(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise MissingWeightsError(f"weight {name}: shape {tuple(src.shape)} does not match the "
                                  f"model's {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


class ScoreHead(nn.Module):
    """`*ForSequenceClassification`'s `score`: [num_labels, hidden], no bias."""

    def __init__(self, num_labels: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: PagedAttentionBackend, max_position: int,
                 use_triton: bool = False, shard: TensorShard = TensorShard(),
                 full_config: ModelConfig | None = None) -> None:
        """cfg: the architecture this process builds — the whole model's, or with tensor
        parallelism one rank's share (`shard_model_config`), `full_config` then being the
        whole model's (what checkpoints hold)."""
        super().__init__()
        self.config = cfg
        self.full_config = full_config or cfg
        self.shard = shard
        ropes = _layer_ropes(cfg, max_position)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layer_cls = _decoder_layer_class(cfg)
        self.layers = nn.ModuleList(
            [layer_cls(cfg, i, ropes[i], backend, use_triton, shard)
             for i in range(cfg.num_hidden_layers)])
        self.norm = make_norm(cfg, cfg.hidden_size, use_triton)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        # A sequence classifier's head (checkpoint name `score.weight`), applied by the engine on
        # the host to pooled hidden states (engine/classifier.py): a plain parameter, not a
        # Linear, so that quantization leaves it alone.
        self.score = ScoreHead(len(cfg.class_labels), cfg.hidden_size) if cfg.is_classifier else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] → the first layer's input [T, hidden]: the embedding rows, for Gemma
        times sqrt(hidden_size) (rounded to the model's dtype first, as transformers does)."""
        h = self.embed_tokens(input_ids)
        if self.config.is_gemma:
            h = h * _embedding_scale(self.config.hidden_size, h.dtype)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] → final hidden states [T, hidden]."""
        h = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        out, _ = self.norm(h, residual)  # type: ignore[misc]
        return out

    def forward_overlapped(self, input_ids: torch.Tensor, positions: torch.Tensor,
                           halves: tuple[AttentionMetadata, AttentionMetadata],
                           streams: MicroBatchStreams) -> torch.Tensor:
        """A pure-decode batch as two micro-batches whose attention and MLP overlap on two
        streams (engine/model/overlap.py); same result as `forward` up to the matmuls' own
        rounding at the halves' shapes. `halves`: the metadata of rows [0, a) and [a, T)
        (`split_decode_metadata`)."""
        split = int(halves[0].seq_lens.shape[0])
        h = self.embed(input_ids)
        rows = (slice(0, split), slice(split, None))
        hs = [h[r] for r in rows]
        pos = [positions[r] for r in rows]
        res: list[torch.Tensor | None] = [None, None]
        md_b = halves[1]
        shared = (h, positions, md_b.seq_lens, md_b.block_tables, md_b.slot_mapping,
                  md_b.query_start_loc)
        with streams.overlap(shared) as lanes:
            for layer in cast(list[LlamaDecoderLayer], list(self.layers)):
                for i in (0, 1):
                    with lanes.lane(i):
                        lanes.wait_other_attention(i)
                        a, res_i = layer.attention_block(pos[i], hs[i], res[i], halves[i])
                        lanes.attention_done(i)
                        hs[i], res[i] = layer.mlp_block(a, res_i)
            res_a, res_b = res
            assert res_a is not None and res_b is not None
            lanes.hand_back((hs[1], res_b))
        out, _ = self.norm(torch.cat(hs), torch.cat((res_a, res_b)))  # type: ignore[misc]
        return out

    def attention_layers(self) -> list[LlamaAttention]:
        """Each decoder layer's attention (an int8 cache's channel factors are set on them)."""
        return [cast(LlamaDecoderLayer, layer).self_attn for layer in self.layers]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden: [N, hidden] → logits [N, vocab]: float32, or in the model's dtype for a
        consumer that widens them itself as it reads them (prompt scoring's kernel). Gemma 2's
        logits are soft-capped, c * tanh(logits / c) (in float32 on the float32 path)."""
        logits = torch.nn.functional.linear(hidden, self.lm_head_weight)
        if float32:
            logits = logits.float()
        cap = self.config.final_logit_softcapping
        return cap * torch.tanh(logits / cap) if cap > 0 else logits

    # ---- weights ---------------------------------------------------------------------------

    _STACKED = (  # (fused param, HF name, shard index)
        ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    def _shard_range(self, fused: str, shard: int, param: torch.Tensor) -> tuple[int, int]:
        """Rows of fused parameter `param` that part `shard` fills (gate/up: halves, whatever
        the MLP's size — the dense MLP's or a shared expert's)."""
        cfg = self.config
        if fused == "qkv_proj":
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        i = param.shape[0] // 2
        return [(0, i), (i, 2 * i)][shard]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; checks completeness.
        With tensor parallelism each tensor is first cut to this rank's slice (`shard_weight`).
        Experts come one tensor per expert and projection (Mixtral's names are read as
        Qwen3-MoE's) and are stacked per layer."""
        params = dict(self.named_parameters())
        stacked = () if self.config.fused_checkpoint else self._STACKED
        # Gemma's norms hold 1 + the checkpoint's w (GemmaRMSNorm).
        unit_offset = {f"{name}.weight" for name, m in self.named_modules()
                       if isinstance(m, GemmaRMSNorm)}
        expected: set[str] = set()
        for name in params:
            if ".experts." in name:
                expected.update(_expert_parts(name, self.config.num_experts))
                continue
            matched = False
            for fused, hf, _ in stacked:
                if f".{fused}." in name:
                    expected.add(name.replace(fused, hf))
                    matched = True
            if not matched:
                expected.add(name)
        loaded: set[str] = set()
        unknown: list[str] = []
        for hf_name, tensor in weights:
            name = canonical_name(hf_name.removeprefix("model."))
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied embeddings: some checkpoints still ship a copy
            part = shard_weight(name, tensor, self.full_config, self.shard)
            if ".experts." in name:
                got = self._load_expert(params, name, part)
                if got is None:
                    unknown.append(hf_name)
                loaded.update(got or ())
                continue
            target, part_of = name, None
            for fused, hf, shard in stacked:
                if f".{hf}." in name:
                    target, part_of = name.replace(hf, fused), (fused, shard)
                    break
            param = params.get(target)
            if param is None:
                unknown.append(hf_name)
                continue
            rows = None if part_of is None else self._shard_range(*part_of, param)
            dst = param if rows is None else param[rows[0]:rows[1]]
            if part is None:  # a row-parallel bias another rank adds
                dst.zero_()
                loaded.add(name)
                continue
            if target in unit_offset:
                part = GemmaRMSNorm.stored_weight(part)
            _copy_checked(hf_name, dst, part)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise MissingWeightsError(f"checkpoint is missing {len(missing)} weights: {missing[:8]}")
        if unknown:
            raise MissingWeightsError(f"checkpoint has unexpected weights: {unknown[:8]}")

    def _load_expert(self, params: dict[str, nn.Parameter], name: str,
                     tensor: torch.Tensor | None) -> list[str] | None:
        """Copy one expert's tensor into its layer's stacked parameter; the loaded part's name,
        None for a name the model has no place for."""
        m = _EXPERT_NAME.match(name)
        if m is None or tensor is None:  # experts have weights only (no biases)
            return None
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        param = params.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
        if param is None or expert >= param.shape[0]:
            return None
        inter = param.shape[1] // 2
        dst = {"gate_proj": param[expert, :inter], "up_proj": param[expert, inter:],
               "down_proj": param[expert]}[proj]
        _copy_checked(name, dst, tensor)
        return [f"{prefix}.{expert}.{proj}.weight"]

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """Random weights of the real shapes (benchmarks), generated on the parameters' device."""
        gen = torch.Generator(device=next(self.parameters()).device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:  # a Gemma norm's stored 1 + w: w = 0, as transformers inits it
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)


def _layer_ropes(cfg: ModelConfig, max_position: int) -> list[RotaryEmbedding]:
    """Each decoder layer's RoPE table, one module per distinct (theta, scaling): one for
    most models, Gemma 3's local and global layers two."""
    tables: dict[tuple[float, Any], RotaryEmbedding] = {}
    for i in range(cfg.num_hidden_layers):
        theta, scaling = key = cfg.layer_rope(i)
        if key not in tables:
            tables[key] = RotaryEmbedding(cfg.head_dim, max_position, theta,
                                          dict(scaling) if scaling is not None else None)
    return [tables[cfg.layer_rope(i)] for i in range(cfg.num_hidden_layers)]


def _decoder_layer_class(cfg: ModelConfig) -> type[LlamaDecoderLayer]:
    if cfg.is_gemma:
        return GemmaDecoderLayer
    return LlamaDecoderLayer


@functools.cache
def _embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """Gemma's embedding multiplier sqrt(hidden_size) as transformers applies it: a float32
    tensor cast to the model's dtype (bf16: sqrt(3072) = 55.43 becomes 55.5), exact as a float."""
    return float(torch.tensor(hidden_size ** 0.5, dtype=torch.float32).to(dtype))
