"""Text <-> token ids, from a `tokenizer.json` (HF) or the vocabulary inside a GGUF file.

Torch-free and transformers-free: the gateway imports it. A GGUF stores a byte-level BPE or a
SentencePiece BPE vocabulary as llama.cpp metadata; `gguf_backend` rebuilds the equivalent HF
`tokenizers` pipeline (byte-level: the pre-tokenizer regex chosen by `tokenizer.ggml.pre` and a
byte-level decoder; SentencePiece: "▁" for spaces, merges ranked by score, byte fallback), with
control tokens as added special tokens so text like "<|im_start|>" is never split).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from engine_api.chat_template import ChatTemplateError, render_chat_template
from engine_api.errors import ModelLoadError

# llama.cpp token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's "▁"

# Pre-tokenizer split regexes as in llama.cpp's llm_tokenizer_bpe / the models' tokenizer.json.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # GPT-2 regex after splitting every digit on its own
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level  # "gpt2", "default" and unknown types: llama.cpp's GPT-2 regex


def gguf_backend(meta: Mapping[str, Any], path: str) -> BackendTokenizer:
    """An HF `tokenizers` pipeline equivalent to the GGUF `tokenizer.ggml.*` metadata: byte-level
    BPE (llama.cpp's "gpt2": Llama 3, Qwen, SmolLM2, Phi-4) or SentencePiece BPE ("llama": Llama
    2, Mistral, TinyLlama, Phi-3)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: Sequence[str] = meta["tokenizer.ggml.tokens"]
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens, types)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types, path)
    else:
        raise ModelLoadError(f"{path}: GGUF tokenizer.ggml.model {kind!r} is not supported; "
                             "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED])
    return backend


def _byte_level_bpe(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]
                    ) -> BackendTokenizer:
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=True)):
        if typ not in (_CONTROL, _USER_DEFINED) and not set(tok) <= alphabet:
            tok = "".join(spell[b] for b in tok.encode("utf-8"))  # stored as raw text
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    if pre in ("qwen2", "deepseek-r1-qwen"):
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int],
                       path: str) -> BackendTokenizer:
    """SentencePiece BPE as llama.cpp stores it: pieces spell a space "▁", bytes without a piece
    fall back to their `<0xXX>` tokens, and a piece's score ranks the merge that makes it (the
    GGUF holds no merges list). The pipeline is Hugging Face's for these models (and what
    `transformers` builds from the same metadata): "▁" before the text and for each space, BPE
    with byte fallback, and a decoder that undoes both and drops the leading space."""
    scores: Sequence[float] | None = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"{path}: a SentencePiece GGUF vocabulary needs one "
                             "tokenizer.ggml.scores entry per token")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    unknown = next((t for t, ty in zip(tokens, types, strict=True) if ty == _UNKNOWN), None)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, vocab),
                                          unk_token=unknown, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _merges_by_score(tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
                     ) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge; merges that make a
    higher-scoring piece apply first (then longer left, then longer right halves; a piece's own
    splits in the order of their halves' ids)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        splits = sorted((vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:])
                         for k in range(1, len(piece))
                         if piece[:k] in vocab and piece[k:] in vocab)
        ranked += [(float(score), len(left), len(right), left, right)
                   for _, _, left, right in splits]
    # Stable: equal keys keep the order above.
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON: {e}") from e
    return d if isinstance(d, dict) else {}


@dataclass
class Tokenizer:
    """A loaded tokenizer plus its special tokens and chat template. Immutable after loading."""

    backend: BackendTokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False  # prepend BOS on encode(add_special_tokens=True) if absent
    chat_template: str | None = None
    special_tokens: dict[str, str | None] = field(default_factory=dict)  # bos_token, eos_token…

    @classmethod
    def from_file(cls, path: str) -> Tokenizer:
        """Load from a .gguf file, a tokenizer.json, or a directory holding tokenizer.json."""
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"tokenizer not found: {path} (expected tokenizer.json or .gguf)")
        if path.endswith(".gguf"):
            return cls._from_gguf(path)
        return cls._from_json(path)

    @classmethod
    def _from_gguf(cls, path: str) -> Tokenizer:
        from engine_api.gguf_meta import read_metadata

        meta = read_metadata(path).values
        backend = gguf_backend(meta, path)
        tokens: Sequence[str] = meta["tokenizer.ggml.tokens"]

        def tok(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
        return cls(
            backend=backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens={"bos_token": tok("bos_token_id"), "eos_token": tok("eos_token_id"),
                            "unk_token": tok("unknown_token_id"),
                            "pad_token": tok("padding_token_id")},
        )

    @classmethod
    def _from_json(cls, path: str) -> Tokenizer:
        try:
            backend = BackendTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON
            raise ModelLoadError(f"{path}: not a valid tokenizer.json: {e}") from e
        folder = os.path.dirname(path)
        tc = _read_json(os.path.join(folder, "tokenizer_config.json"))
        special = {k: _token_text(tc.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                       "pad_token")}
        eos_ids = [backend.token_to_id(special["eos_token"])] if special["eos_token"] else []
        for extra in ("generation_config.json", "config.json"):
            found = _read_json(os.path.join(folder, extra)).get("eos_token_id")
            eos_ids += found if isinstance(found, list) else [found]
        bos = special["bos_token"]
        chat = cls._json_chat_template(folder, tc)
        return cls(
            backend=backend,
            bos_token_id=backend.token_to_id(bos) if bos else None,
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos_ids if isinstance(e, int))),
            add_bos_token=bool(tc.get("add_bos_token", False)),
            chat_template=chat,
            special_tokens=special,
        )

    @staticmethod
    def _json_chat_template(folder: str, tc: dict[str, Any]) -> str | None:
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                return f.read()
        value = tc.get("chat_template")
        if isinstance(value, list):
            value = {t.get("name"): t.get("template") for t in value
                     if isinstance(t, dict)}.get("default")
        return value if isinstance(value, str) else None

    # --- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text ("<|im_start|>") maps to its single id."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of `text` with any special-token text in it ("<|im_start|>") taken as
        plain text, as a message's text must be (no BOS added)."""
        return list(self._text_only_backend.encode(text, add_special_tokens=False).ids)

    @functools.cached_property
    def _text_only_backend(self) -> BackendTokenizer:
        backend = BackendTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @functools.cached_property
    def special_token_texts(self) -> tuple[str, ...]:
        """The text of each special token, longest first (a longer one may contain a shorter)."""
        texts = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        return tuple(sorted(texts, key=lambda t: (-len(t), t)))

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Token ids of `text` and `pair` as one input, as `transformers`' `tokenizer(text,
        pair)` makes a cross-encoder's input: the tokenizer's own pair template where it has
        one (BERT-style separators), else the two encodings one after the other; BOS as
        `encode` adds it."""
        ids: list[int] = self.backend.encode(text, pair, add_special_tokens=True).ids
        bos = self.bos_token_id
        if self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    # --- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, chat_template: str | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Render `messages` with the model's chat template, or `chat_template` in its place
        (text, or ids when tokenize=True); `kwargs` are template variables (`tools`, ...).

        Like transformers, the rendered text is tokenized without adding BOS again: the
        template writes any BOS itself.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        text = render_chat_template(template, messages, add_generation_prompt,
                                    self.special_tokens, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text
