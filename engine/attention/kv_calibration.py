"""Per-layer K/V scales for a quantized KV cache: from a calibration pass or from a JSON file.

An int8 cache stores `round(x / scale)` in [-127, 127], a fixed step of `scale` across the whole
range, so its scales must fit the activations: too large wastes the 8 bits, too small saturates.
The engine runs one prefill of a fixed calibration text through the model with a float cache,
takes each layer's largest |K| (after RoPE, as cached) and |V|, and sets `scale = amax / 127`
(TensorRT-LLM's INT8 KV cache takes the same from its calibration; LMDeploy's per-token scales
avoid calibration at the cost of a second tensor per block, which every KV hop here would then
have to carry). Values beyond the calibration's range saturate at ±127 * scale.

The scales are rounded *up* to 4 significant bits (`round_scales`): two workers whose passes
differ in the last bits (another kernel, another GPU) then almost always agree exactly, and a
decode worker takes a prefill worker's blocks only under equal scales (kv_transfer refuses
others). Where prefill and decode run on different hardware, give both the same scales file
(`--kv-scales FILE`, written by `splitserve kv-scales`). The rounding costs at most 1/16 of the
range.

An int8 cache also has per-channel factors within each layer (engine/attention/kv_channels.py),
from the same pass's per-channel maxima.

File format (JSON): `{"kv_cache_dtype": "int8", "granularity": "channel", "k_scale": [L floats],
"v_scale": [L floats], "k_channel_factors": [L][Hkv][D] floats, "v_channel_factors": likewise}`.
`granularity` "layer" (or absent: files written before channel factors) has no factor lists:
every factor is 1. `kv_cache_dtype` is informational (a file fits any quantized cache of the
model; an fp8 cache ignores the factors).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError

SCALE_MANTISSA_BITS = 4
# A 70B model's factors (80 layers x 8 KV heads x 128 x 2) print to ~1.6 MB.
MAX_SCALES_FILE_BYTES = 16 << 20
GRANULARITIES = ("layer", "channel")

# A fixed, varied text (prose, dialogue, code, numbers, markup): what served prompts hold.
CALIBRATION_MESSAGES = (
    ("system", "You are a careful assistant. Answer briefly, cite numbers exactly, and say so "
               "when you do not know."),
    ("user", "Our warehouse in Rotterdam shipped 1,284 pallets in March, 17% more than in "
             "February. Each pallet weighs about 420 kg. Roughly how many tonnes left the "
             "warehouse in March, and what was February's count?"),
    ("assistant", "March: 1,284 x 420 kg = 539,280 kg, about 539 tonnes. February: "
                  "1,284 / 1.17 = 1,097 pallets (rounded)."),
    ("user", "Write a Python function that returns the n-th Fibonacci number without "
             "recursion, with a docstring and a type hint.\n\n```python\ndef fib(n: int) -> "
             "int:\n    \"\"\"Return F(n), F(0) = 0.\"\"\"\n    a, b = 0, 1\n    for _ in "
             "range(n):\n        a, b = b, a + b\n    return a\n```\nIs this correct for "
             "n = 0 and n = 1? What about negative n?"),
    ("assistant", "Yes: fib(0) returns 0 and fib(1) returns 1. For a negative n the loop does "
                  "not run and it returns 0; raise ValueError instead if that matters."),
    ("user", "Translate to French and German: 'The meeting moved to Thursday at 14:30; bring "
             "the signed contract (v2.3) and your badge.' Then summarise the plot of Hamlet "
             "in two sentences. <table><tr><td>id</td><td>42</td></tr></table> {\"ok\": true, "
             "\"items\": [1, 2, 3]} SELECT name FROM users WHERE age > 30 ORDER BY name;"),
)


def calibration_token_ids(tokenizer: Any | None, vocab_size: int, length: int = 384
                          ) -> list[int]:
    """The calibration prompt's token ids: the messages through the model's chat template (or
    joined as plain text), or, for a model without a tokenizer (dummy weights), `length`
    pseudo-random ids from a fixed seed."""
    if tokenizer is not None:
        messages = [{"role": r, "content": c} for r, c in CALIBRATION_MESSAGES]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
        else:
            ids = tokenizer.encode("\n\n".join(c for _, c in CALIBRATION_MESSAGES))
        ids = [i for i in ids if 0 <= i < vocab_size]
        if ids:
            return list(ids)
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def round_scales(scales: torch.Tensor, bits: int = SCALE_MANTISSA_BITS) -> torch.Tensor:
    """Each scale rounded up to `bits` significant bits (float32)."""
    out = []
    for s in scales.reshape(-1).tolist():
        _, exponent = math.frexp(s)  # s = m * 2**exponent, m in [0.5, 1)
        step = 2.0 ** (exponent - bits)
        out.append(math.ceil(s / step) * step)
    return torch.tensor(out, dtype=torch.float32).reshape(scales.shape)


def load_kv_scales(path: str | Path, num_layers: int, num_kv_heads: int, head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A scales file → (`[num_layers, 2]` float32 (K, V) scales, `[num_layers, 2, num_kv_heads,
    head_dim]` float32 channel factors or None for a per-layer file); ConfigError names what is
    wrong."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_SCALES_FILE_BYTES:
            raise ConfigError(f"KV scales file {p} is larger than {MAX_SCALES_FILE_BYTES} bytes")
        doc = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read KV scales file {p}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"KV scales file {p} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"KV scales file {p} must hold a JSON object")
    columns = [_positive_list(p, doc.get(key), key, num_layers, "one per layer")
               for key in ("k_scale", "v_scale")]
    scales = torch.tensor(columns, dtype=torch.float32).t().contiguous()
    granularity = doc.get("granularity", "layer")
    if granularity not in GRANULARITIES:
        raise ConfigError(f"KV scales file {p}: 'granularity' must be one of "
                          f"{', '.join(GRANULARITIES)}, got {granularity!r}")
    if granularity == "layer":
        return scales, None
    parts = []
    for key in ("k_channel_factors", "v_channel_factors"):
        rows = doc.get(key)
        if not isinstance(rows, list) or len(rows) != num_layers:
            raise ConfigError(f"KV scales file {p}: {key!r} must be a list of {num_layers} "
                              f"layers of {num_kv_heads} heads of {head_dim} numbers")
        parts.append([[_positive_list(p, head, key, head_dim, "one per channel")
                       for head in _list_of(p, layer, key, num_kv_heads)] for layer in rows])
    factors = torch.tensor(parts, dtype=torch.float32).transpose(0, 1).contiguous()
    problem = check_factors(factors, (num_layers, 2, num_kv_heads, head_dim))
    if problem is not None:
        raise ConfigError(f"KV scales file {p}: {problem}")
    return scales, factors


def _list_of(p: Path, value: Any, key: str, n: int) -> list[Any]:
    if not isinstance(value, list) or len(value) != n:
        raise ConfigError(f"KV scales file {p}: each layer of {key!r} must be a list of {n} "
                          f"heads")
    return value


def _positive_list(p: Path, values: Any, key: str, n: int, what: str) -> list[float]:
    """`values` as n positive finite floats; ConfigError otherwise."""
    if not isinstance(values, list) or len(values) != n:
        raise ConfigError(f"KV scales file {p}: {key!r} must be a list of {n} numbers ({what})")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not (
                0.0 < float(v) < math.inf):
            raise ConfigError(f"KV scales file {p}: {key!r} holds {v!r}; scales must be "
                              f"positive finite numbers")
    return [float(v) for v in values]


def kv_scales_document(scales: torch.Tensor, kv_cache_dtype: str,
                       factors: torch.Tensor | None = None) -> dict[str, Any]:
    """`[L, 2]` scales (and `[L, 2, Hkv, D]` channel factors) → the JSON object
    `load_kv_scales` reads."""
    doc: dict[str, Any] = {"kv_cache_dtype": kv_cache_dtype,
                           "granularity": "layer" if factors is None else "channel",
                           "k_scale": [float(v) for v in scales[:, 0].tolist()],
                           "v_scale": [float(v) for v in scales[:, 1].tolist()]}
    if factors is not None:
        doc["k_channel_factors"] = factors[:, 0].tolist()
        doc["v_channel_factors"] = factors[:, 1].tolist()
    return doc


def check_factors(factors: torch.Tensor, shape: tuple[int, int, int, int]) -> str | None:
    """What is wrong with `factors` for a model of `shape` ([L, 2, Hkv, D]), or None: the shape,
    finite positive values, K's equal across RoPE pairs."""
    if tuple(factors.shape) != shape:
        return f"channel factors have shape {tuple(factors.shape)}, expected {shape}"
    if not bool((torch.isfinite(factors) & (factors > 0)).all()):
        return "channel factors must be positive finite numbers"
    half = shape[-1] // 2
    k = factors[:, 0]
    if not torch.equal(k[..., :half], k[..., half:]):
        return (f"K's channel factors must be equal across RoPE pairs (channel i and i + "
                f"{half})")
    return None
