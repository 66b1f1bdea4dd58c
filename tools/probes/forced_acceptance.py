"""Speculative decoding at a chosen acceptance on a dummy model: a target whose greedy token is
known before it is computed, and a drafter that proposes it with a chosen probability (for
tools/probes/probe_spec_policy_gpu.py).

Why not replay a reference run's tokens as drafts: those are right only while the engine's own
decoding follows the reference. With random weights the logits are near ties, and bf16 rounds a
verify step of 1 + k rows per sequence differently from a plain step, so a speculative run
parts from the plain one within a few tokens; after that every draft is wrong (on the H200 at
c86461f acceptance came out at 1-4% whatever rate was forced).

The chain model: the dummy model's weights are changed in place so that greedy decoding always
picks `chain.next(last token)` = (token + STRIDE) mod vocab, with a margin far beyond any
rounding:
- every embedding row is scaled to EMBED_RMS per element (its direction kept), so the residual
  stream stays the current token's embedding, the layers' random contributions a small part of
  it (2.4 per element each at the 8B's layer shapes and 0.02 init, measured in bf16 on a CPU;
  independent, the 32 layers add up to ~14);
- lm_head row `next(x)` is x's embedding direction times the final norm's weight, of norm
  HEAD_NORM. The final hidden state points along its own token's embedding: the right row scores
  about HEAD_NORM * sqrt(hidden), any other about that times (a random cosine, under
  4.9 / sqrt(hidden) over the 8B's 128k rows), so rounding cannot move the argmax.
Every layer still runs at its real shapes on its random weights (the attention, the MLP, the
KV cache read), so a step costs what it costs on the model; only what the tokens are changes.

The drafter (`ChainDrafter`) proposes the chain from the sequence's last token, each draft
replaced by a wrong token with probability 1 - rate. The coin of draft j at sequence length n
is a hash of (the sequence's first tokens, n, j): runs of the same prompts draw the same coins,
and a verify step accepts its first draft with probability `rate` and i + 1 drafts with
probability rate^(i+1), whatever the batch, dtype or step shape. `rate = 0` gives drafts that are
never accepted (a verify step's cost alone).

Not chosen: running the target in float32 (exact, but the step costs measured would be float32
kernels', not bf16's); a reference decoded at the verify step's own shapes (it would have to be
decoded again at every batch, k and acceptance, and a step's shape follows the acceptance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.llm_engine import LLMEngine
from engine.spec import SequenceProposer

STRIDE = 7919           # next(x) = x + STRIDE (mod vocab): a prime, so no fixed point, long cycles
EMBED_RMS = 64.0        # per-element rms of an embedding row (the dummy init's is 0.02)
HEAD_NORM = 1.28        # norm of an lm_head row (the dummy init's on the 8B: 0.02 * sqrt(4096))
_CHUNK_ROWS = 16384     # rows rewritten at a time (the 8B's float32 embedding is 2 GB)
_SEQ_KEY_TOKENS = 8     # the prompt tokens that tell sequences apart for the coins
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Chain:
    """The chain model's greedy rule: the token after x."""

    vocab: int
    stride: int = STRIDE

    def next(self, token: int) -> int:
        return (token + self.stride) % self.vocab

    def continuation(self, last: int, n: int) -> list[int]:
        """The n tokens greedy decoding emits after `last`."""
        out = []
        for _ in range(n):
            last = self.next(last)
            out.append(last)
        return out


@torch.no_grad()
def make_chain_model(engine: LLMEngine, stride: int = STRIDE) -> Chain:
    """Rewrite the engine's embedding and lm_head in place (module docstring); returns the
    rule its greedy decoding now follows. A Llama-family model of one rank with an untied
    head and no weight quantization (the dummy presets the probe runs)."""
    cfg = engine.config
    if cfg.parallel.tensor_parallel_size != 1 or cfg.runner.quantization != "none":
        raise ValueError("the chain model needs one rank and unquantized weights")
    model = engine.runner.model
    if model.lm_head is None or engine.model_config.is_gemma:
        raise ValueError("the chain model needs a Llama-style model with an lm_head of its own")
    emb = model.embed_tokens.weight
    head = model.lm_head.weight
    vocab = emb.shape[0]
    if stride % vocab == 0:
        raise ValueError(f"stride {stride} is a multiple of the vocabulary ({vocab})")
    norm_w = model.norm.weight.float()
    for start in range(0, vocab, _CHUNK_ROWS):
        rows = emb[start:start + _CHUNK_ROWS].float()
        unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
        emb[start:start + _CHUNK_ROWS] = (unit * EMBED_RMS * emb.shape[1] ** 0.5).to(emb.dtype)
        h = unit * norm_w
        h = h / h.norm(dim=1, keepdim=True).clamp_min(1e-12) * HEAD_NORM
        dest = (torch.arange(start, start + rows.shape[0], device=emb.device) + stride) % vocab
        head.index_copy_(0, dest, h.to(head.dtype))
    return Chain(vocab, stride)


def _unit(a: int, b: int, c: int) -> float:
    """A uniform number in [0, 1) from three integers (splitmix64's finaliser)."""
    z = (a * 0x9E3779B97F4A7C15 + b * 0xBF58476D1CE4E5B9 + c * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


class ChainDrafter(SequenceProposer):
    """Drafts the chain model's continuation, each draft right with probability `rate` (a wrong
    one is the right token + 1, which the chain never picks after the same token)."""

    def __init__(self, chain: Chain, rate: float) -> None:
        self.chain = chain
        self.rate = rate

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        key = hash(tuple(token_ids[:_SEQ_KEY_TOKENS])) & _MASK64
        n = len(token_ids)
        drafts = []
        for j, right in enumerate(self.chain.continuation(token_ids[-1], k)):
            ok = _unit(key, n, j) < self.rate
            drafts.append(right if ok else (right + 1) % self.chain.vocab)
        return drafts
