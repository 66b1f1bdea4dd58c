"""Piecewise CUDA graphs: a step's layers replayed from graphs, its attention launched eagerly.

A step that carries prompt tokens cannot replay the decode graphs: its attention depends on the
step's layout on the host (which sequences are prompts and how long, `prefill_plan`). Run
eagerly, each layer costs ~15 launches from Python, 0.4-1.7 ms of host time on the H200's hosts
for an 8B model: a step of up to a few hundred tokens waits on the host, not the GPU
(docs/performance.md, "Short prompts"). So, per token-count bucket, everything *between* two
attentions is captured as one graph:

    piece 0      embedding; layer 0's input norm (+ residual), QKV projection, RoPE + KV write
    piece l      layer l-1's O projection, post-attention norm, MLP;
                 layer l's input norm, QKV projection, RoPE + KV write
    piece L      layer L-1's O projection, post-attention norm, MLP; the final norm

and a step replays piece 0, then per layer launches attention over the paged cache (the
kernels an eager step runs: `LlamaAttention.attend_cached`) on its real rows and replays the
next piece. Pieces read and write static buffers of the largest bucket; rows past the step's
tokens are padding: their KV slot is -1 (not written), and every other op in a piece works row
by row, so padding never reaches a real row (attention, the one op across rows, never sees
it). vLLM V1's piecewise graphs (torch.compile split at attention) are the same idea. On the
H200 (8B, bf16) a prompt's first token went from 15-17 ms eager to 5.3 ms (16 tokens), 6.2 ms
(128) and 12.2 ms (512) (docs/performance.md, "Piecewise CUDA graphs").

All pieces of all buckets share one graph pool: they are captured and replayed in the same
order, and each piece's own temporaries are dead once it has copied its results into the
static buffers, so a later piece may reuse their memory.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from engine.attention.forward_context import AttentionMetadata, layer_kv_scale
from engine.cuda_graphs import WARMUP_RUNS, GraphHost

if TYPE_CHECKING:
    from engine.model.decoder import LlamaDecoderLayer

logger = logging.getLogger(__name__)

# The smallest bucket: below it the matmuls cost the same (they stream the weights), so padding
# a step up to it is free, and fewer buckets capture faster.
MIN_PIECEWISE_BUCKET = 16


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token counts captured: powers of two from 16 to 256, then every 128, then `max_tokens`.
    Finer steps past 256 because there the padded rows start to cost matmul time."""
    sizes = [b for b in (16, 32, 64, 128, 256) if b <= max_tokens]
    sizes += list(range(384, max_tokens + 1, 128))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class PiecewiseGraphRunner:
    """The pieces of every bucket for one model runner. `capture=False` (the CPU, where there
    are no graphs) runs the same pieces on the same static buffers without capturing them:
    the tests check the layout, padding and buffer hand-offs that way."""

    def __init__(self, runner: GraphHost, max_tokens: int, pool: Any = None,
                 capture: bool = True) -> None:
        self.model = runner.model
        self.layers = cast("list[LlamaDecoderLayer]", list(self.model.layers))
        self.buckets = piecewise_buckets(max_tokens)
        self.use_graphs = capture
        cfg = runner.model_config
        n, dev, dtype = self.buckets[-1], runner.device, runner.dtype
        q_size = cfg.num_attention_heads * cfg.head_dim
        qkv_size = q_size + 2 * cfg.num_key_value_heads * cfg.head_dim
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.qkv = torch.zeros(n, qkv_size, dtype=dtype, device=dev)
        self.attn = torch.zeros(n, q_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        # Per layer: its cache and (k_scale, v_scale), fixed for the engine's life.
        self.kv_caches = runner.kv_caches
        self.kv_scales = [layer_kv_scale(runner.kv_scale_values, i)
                          for i in range(len(self.layers))]
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool: Any = pool
        self.num_steps = 0

    # ---- the pieces ------------------------------------------------------------------------

    def _piece(self, i: int, t: int) -> None:
        """Piece `i` at bucket `t`: reads `input_ids` (piece 0) or `attn` + `residual`, writes
        `qkv` + `residual` and layer i's KV (or `hidden`, the last piece)."""
        if i == 0:
            h = self.model.embed(self.input_ids[:t])
            qkv, residual = self.layers[0].qkv_block(h, None)
        else:
            h, residual = self.layers[i - 1].post_attention_block(self.attn[:t],
                                                                  self.residual[:t])
            if i == len(self.layers):
                out, _ = self.model.norm(h, residual)  # type: ignore[misc]
                self.hidden[:t].copy_(out)
                return
            qkv, residual = self.layers[i].qkv_block(h, residual)
        self.qkv[:t].copy_(qkv)
        self.residual[:t].copy_(residual)
        attn = self.layers[i].self_attn
        q, k, _ = attn.rotate_and_write_kv(self.positions[:t], self.qkv[:t], self.kv_caches[i],
                                           self.slot_mapping[:t], self.kv_scales[i])
        q_buf, k_buf, _ = attn.split_qkv(self.qkv[:t])
        if q.data_ptr() != q_buf.data_ptr():  # rotated out of place (a backend without RoPE)
            q_buf.copy_(q)
            k_buf.copy_(k)

    def _pieces(self, t: int) -> list[Callable[[], None]]:
        return [functools.partial(self._piece, i, t) for i in range(len(self.layers) + 1)]

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream) -> None:
        """Capture every bucket on `stream` (a side stream; the runner's one for all captures)."""
        if not self.use_graphs:
            return
        reserved_before = torch.cuda.memory_reserved()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for t in reversed(self.buckets):  # largest first: later ones reuse its pool
                pieces = self._pieces(t)
                for _ in range(WARMUP_RUNS):  # kernel compilation off the graph
                    for piece in pieces:
                        piece()
                torch.cuda.synchronize()
                graphs = []
                for piece in pieces:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, stream=stream):
                        piece()
                    if self.pool is None:
                        self.pool = g.pool()
                    graphs.append(g)
                self.graphs[t] = graphs
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved() - reserved_before
        logger.info("captured piecewise CUDA graphs: %d buckets of %d pieces (up to %d tokens) "
                    "using %.2f GiB", len(self.graphs), len(self.layers) + 1, self.buckets[-1],
                    used / 2**30)

    # ---- a step ----------------------------------------------------------------------------

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
            ) -> torch.Tensor:
        """The model's forward pass for one step of `T = len(input_ids)` tokens laid out as
        `md` says. Returns the final hidden states [T, hidden]: a view of the static buffer,
        valid until the next step."""
        num_tokens = input_ids.shape[0]
        t = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(md.slot_mapping, non_blocking=True)
        if t > num_tokens:
            self.slot_mapping[num_tokens:t].fill_(-1)  # padding rows write no KV
        pieces = ([g.replay for g in self.graphs[t]] if self.use_graphs else self._pieces(t))
        for i, layer in enumerate(self.layers):
            pieces[i]()
            q, k, v = layer.self_attn.split_qkv(self.qkv[:num_tokens])
            o = layer.self_attn.attend_cached(q, k, v, self.kv_caches[i], md, self.kv_scales[i])
            self.attn[:num_tokens].copy_(o)
        pieces[-1]()
        self.num_steps += 1
        return self.hidden[:num_tokens]
