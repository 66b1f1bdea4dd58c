"""Write a byte-level BPE `tokenizer.json` of any vocabulary size, for serving dummy weights.

`--load-format dummy` models (e.g. `dummy:llama-3.1-8b`, 128,256 tokens) come without a
tokenizer, but the gateway must detokenize what they generate, and no real tokenizer may be
fetched from a hub. This writes one whose vocabulary has the model's size: the 256 byte symbols
of byte-level BPE, then seeded pseudo-words (about 2–8 characters, some with a leading space, as
in Llama 3's vocabulary), then `<|begin_of_text|>` / `<|eot_id|>` at Llama 3's ids when they fit.
It has no merges, so it only serves to *decode* ids (benchmarks send prompts as token ids);
decoding costs what a real byte-level vocabulary costs, which is what an online benchmark of
the gateway should pay.

    python -m tools.synthetic_tokenizer --vocab-size 128256 --out-dir /tmp/tok
    splitserve up --model dummy:llama-3.1-8b --tokenizer /tmp/tok/tokenizer.json ...
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_api.tokenizer import _bytes_to_unicode

BOS_TEXT, EOS_TEXT = "<|begin_of_text|>", "<|eot_id|>"
LLAMA3_BOS_ID, LLAMA3_EOS_ID = 128000, 128009
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _special_ids(vocab_size: int) -> tuple[int, int]:
    """(bos, eos): Llama 3's ids when the vocabulary holds them, else the last two ids."""
    if vocab_size > LLAMA3_EOS_ID:
        return LLAMA3_BOS_ID, LLAMA3_EOS_ID
    return vocab_size - 2, vocab_size - 1


def build_vocab(vocab_size: int, seed: int = 0) -> dict[str, int]:
    """token text → id for ids [0, vocab_size); every id is used exactly once."""
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes + bos + eos), got {vocab_size}")
    bos_id, eos_id = _special_ids(vocab_size)
    byte_syms = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {sym: i for i, sym in enumerate(byte_syms)}
    # The special tokens belong in the model's vocabulary too: `tokenizers` gives an added token
    # missing from it a new id after the last one.
    vocab.update({BOS_TEXT: bos_id, EOS_TEXT: eos_id})
    rng = random.Random(seed)
    space = _bytes_to_unicode()[ord(" ")]
    next_id = len(byte_syms)
    while next_id < vocab_size:
        if next_id in (bos_id, eos_id):
            next_id += 1
            continue
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 8)))
        text = space + word if rng.random() < 0.6 else word
        if text not in vocab:
            vocab[text] = next_id
            next_id += 1
    return vocab


def tokenizer_json(vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """The tokenizer.json document (Hugging Face `tokenizers` format)."""
    bos_id, eos_id = _special_ids(vocab_size)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in ((bos_id, BOS_TEXT),
                                                                  (eos_id, EOS_TEXT))]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": build_vocab(vocab_size, seed), "merges": []},
    }


def write(out_dir: Path, vocab_size: int, seed: int = 0) -> Path:
    """Write tokenizer.json and tokenizer_config.json into out_dir; returns tokenizer.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json(vocab_size, seed), ensure_ascii=False))
    config = {"bos_token": BOS_TEXT, "eos_token": EOS_TEXT, "add_bos_token": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.synthetic_tokenizer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write(args.out_dir, args.vocab_size, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
