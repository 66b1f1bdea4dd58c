"""Llama-family decoder over a paged KV cache: Llama 2/3/3.1, Mistral, Qwen2 (QKV bias), Qwen3
(RMSNorm over each head of q and k), Phi-3/Phi-4 (checkpoints already fused), SmolLM2, and
Gemma 2/3 (their decoder layer in `gemma.py`; scaled embeddings, soft-capped logits here).

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
    RopeInputs,
    current_lora,
    get_forward_context,
)
from engine.config import ModelConfig
from engine.model.layers import (
    GemmaRMSNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    act_and_mul,
    gemv_enabled,
    make_norm,
)
from engine.model.moe import SparseMoeBlock
from engine.model.overlap import MicroBatchStreams
from engine.parallel.group import all_reduce_
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


def _with_lora(layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y = the base projection `fused` of x, plus the step's LoRA deltas on their rows."""
    lora = current_lora()
    if lora is None:
        return y
    stack, batch = lora
    return stack.apply(layer, fused, x, y, batch)


def _one_row_fused(use_gemv: bool, x: torch.Tensor) -> bool:
    """Whether a one-row batch folds its RMSNorm into the projection's GEMV: not when a LoRA
    adapter runs in the step (its delta needs the normalised input)."""
    return use_gemv and x.shape[0] == 1 and current_lora() is None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding,
                 backend: PagedAttentionBackend, use_triton: bool = False,
                 shard: TensorShard = TensorShard()) -> None:
        """cfg: this rank's architecture (`shard_model_config`: its heads and KV heads)."""
        super().__init__()
        self.reduce = shard.is_split  # the row-parallel projection's output: a partial sum
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attention_scale
        self.sliding_window = cfg.layer_window(layer_idx)  # 0: full attention
        self.logit_softcap = cfg.attn_logit_softcapping    # 0: none
        use_gemv = use_triton and gemv_enabled()
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               cfg.attention_bias, use_gemv)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, use_gemv)
        # Qwen3, Gemma 3: each head of q and k normalised over head_dim (one weight shared by
        # the heads) before RoPE.
        self.q_norm = make_norm(cfg, self.head_dim, use_triton) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, self.head_dim, use_triton) if cfg.qk_norm else None
        self.rope = rope
        self.backend = backend

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                md: AttentionMetadata | None = None) -> torch.Tensor:
        """x: [T, hidden]. `md`: this batch's metadata when it is not the forward context's
        (one micro-batch of an overlapped step)."""
        return self.attend(positions, self.project_qkv(x), md)

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        """The fused QKV projection of the normalised input (with the step's LoRA deltas)."""
        return _with_lora(self.layer_idx, "qkv_proj", h, self.qkv_proj(h))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               md: AttentionMetadata | None = None) -> torch.Tensor:
        """The rest of `forward` after the QKV projection: RoPE + KV write, attention, O."""
        return self.project_output(self.attention_output(positions, qkv, md))

    def project_output(self, o: torch.Tensor) -> torch.Tensor:
        """The O projection of attention's output (with the step's LoRA deltas), summed over the
        tensor-parallel ranks."""
        out = _with_lora(self.layer_idx, "o_proj", o, self.o_proj(o))
        return all_reduce_(out) if self.reduce else out

    def attention_output(self, positions: torch.Tensor, qkv: torch.Tensor,
                         md: AttentionMetadata | None = None) -> torch.Tensor:
        """RoPE + KV write and attention over the paged cache: [T, heads * head_dim], before the
        O projection. The part of a layer that reads the step's metadata."""
        ctx = get_forward_context()
        md = ctx.attn_metadata if md is None else md
        kv_cache = ctx.kv_caches[self.layer_idx]
        kv_scale = ctx.kv_scale(self.layer_idx)
        q, k, v = self.rotate_and_write_kv(positions, qkv, kv_cache, md.slot_mapping, kv_scale)
        return self.attend_cached(q, k, v, kv_cache, md, kv_scale)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views [T, H, D], [T, Hkv, D], [T, Hkv, D] of a fused QKV projection [T, q + 2 kv]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.reshape(-1, self.num_heads, self.head_dim),
                k.reshape(-1, self.num_kv_heads, self.head_dim),
                v.reshape(-1, self.num_kv_heads, self.head_dim))

    def rotate_and_write_kv(self, positions: torch.Tensor, qkv: torch.Tensor,
                            kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            kv_scale: tuple[float, float]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE on q and k and k, v into the cache at `slot_mapping`; returns (q, k, v) rotated:
        views of `qkv` rotated in place when the backend fuses RoPE, new tensors otherwise.
        Reads nothing else of the step, so piecewise CUDA graphs capture it with the layers."""
        q, k, v = self.split_qkv(qkv)
        if self.q_norm is not None and self.k_norm is not None:
            q = self._head_norm(self.q_norm, q)
            k = self._head_norm(self.k_norm, k)
        rope: RopeInputs | None = None
        if self.backend.fuses_rope:  # RotaryEmbedding is neox style
            rope = RopeInputs(positions, self.rope.cos_sin_cache, is_neox=True)
        else:
            q, k = self.rope(positions, q, k)
        self.backend.write_kv(q, k, v, kv_cache, slot_mapping, kv_scale, rope=rope)
        return q, k, v

    @staticmethod
    def _head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head of x [T, H, D] over D: a new contiguous [T, H, D]. With one
        head (k of a multi-query model, or of a tensor-parallel rank) the reshape of a slice of
        the fused QKV output is still a strided view: the Triton norm needs its rows dense."""
        t, h, d = x.shape
        return cast(torch.Tensor, norm(x.reshape(t * h, d).contiguous())).view(t, h, d)

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: torch.Tensor, md: AttentionMetadata,
                      kv_scale: tuple[float, float]) -> torch.Tensor:
        """Attention after `rotate_and_write_kv`: [T, heads * head_dim]."""
        o = self.backend.attend(q, k, v, kv_cache, md, self.scale, kv_scale,
                                sliding_window=self.sliding_window,
                                logit_softcap=self.logit_softcap)
        return o.reshape(-1, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, use_triton: bool, use_gemv: bool | None = None,
                 shard: TensorShard = TensorShard(), layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.reduce = shard.is_split
        self.use_gemv = use_triton and gemv_enabled() if use_gemv is None else use_gemv
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias,
                                   self.use_gemv)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
                                self.use_gemv)
        self.use_triton = use_triton
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A one-row batch in the model never gets here with the GEMV on: the decoder layer runs
        # norm + gate/up + activation as one kernel (`norm_and_mlp`) and calls `project_down`.
        gate_up = _with_lora(self.layer_idx, "gate_up_proj", x, self.gate_up_proj(x))
        return self.project_down(act_and_mul(gate_up, self.act, self.use_triton))

    def project_down(self, act: torch.Tensor) -> torch.Tensor:
        """The down projection (with the step's LoRA deltas), summed over the tensor-parallel
        ranks."""
        out = _with_lora(self.layer_idx, "down_proj", act, self.down_proj(act))
        return all_reduce_(out) if self.reduce else out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding,
                 backend: PagedAttentionBackend, use_triton: bool,
                 shard: TensorShard = TensorShard()) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rope, backend, use_triton, shard)
        self.mlp: LlamaMLP | SparseMoeBlock = (
            SparseMoeBlock(cfg, use_triton, shard) if cfg.is_sparse_layer(layer_idx)
            else LlamaMLP(cfg, use_triton, shard=shard, layer_idx=layer_idx))
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, use_triton)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, use_triton)
        # Batch-1 rows fold each RMSNorm into the projection after it (one GEMV kernel reads
        # the residual stream, normalises and streams the weight: engine/kernels/gemv.py).
        self.use_gemv = use_triton and gemv_enabled()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.attention_block(positions, x, residual)
        return self.mlp_block(h, residual)

    def attention_block(self, positions: torch.Tensor, x: torch.Tensor,
                        residual: torch.Tensor | None, md: AttentionMetadata | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (+ residual add), QKV, RoPE + KV write, attention, O projection."""
        if _one_row_fused(self.use_gemv, x):
            from engine.kernels.gemv import rms_norm_gemv
            norm = self.input_layernorm
            weight, bias, scale = self.self_attn.qkv_proj.gemv_operands()
            qkv, residual = rms_norm_gemv(x, norm.weight, norm.eps, weight, bias,
                                          residual=residual, weight_scale=scale)
            return self.self_attn.attend(positions, qkv, md), residual
        qkv, residual = self.qkv_block(x, residual)
        return self.self_attn.attend(positions, qkv, md), residual

    def qkv_block(self, x: torch.Tensor, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (+ residual add) and the QKV projection, for more than one row: what a
        layer computes before attention. Returns (qkv, residual)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)  # type: ignore[misc]
        return self.self_attn.project_qkv(h), residual  # type: ignore[arg-type]

    def post_attention_block(self, o: torch.Tensor, residual: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a layer computes after attention: the O projection, then `mlp_block`."""
        return self.mlp_block(self.self_attn.project_output(o), residual)

    def mlp_block(self, h: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-attention norm (+ residual add), gate/up, activation-and-mul, down (or the
        experts). h: attention's output after the O projection."""
        return self.norm_and_mlp(self.post_attention_layernorm, h, residual)

    def norm_and_mlp(self, norm: RMSNorm, h: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm(h + residual)` into the MLP: returns (MLP output, h + residual). A one-row
        batch folds the norm and the activation into the gate/up GEMV."""
        if isinstance(self.mlp, LlamaMLP) and _one_row_fused(self.use_gemv, h):
            from engine.kernels.gemv import rms_norm_gemv
            weight, bias, scale = self.mlp.gate_up_proj.gemv_operands()
            act, residual = rms_norm_gemv(h, norm.weight, norm.eps, weight, bias,
                                          residual=residual, gated=True, weight_scale=scale,
                                          activation=self.mlp.act)
            return self.mlp.project_down(act), residual
        h, residual = norm(h, residual)  # type: ignore[misc]
        return self.mlp(h), residual


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
        from engine.model.gemma import GemmaDecoderLayer  # it subclasses LlamaDecoderLayer
        return GemmaDecoderLayer
    return LlamaDecoderLayer


@functools.cache
def _embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """Gemma's embedding multiplier sqrt(hidden_size) as transformers applies it: a float32
    tensor cast to the model's dtype (bf16: sqrt(3072) = 55.43 becomes 55.5), exact as a float."""
    return float(torch.tensor(hidden_size ** 0.5, dtype=torch.float32).to(dtype))
