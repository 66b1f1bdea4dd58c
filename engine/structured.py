"""Structured outputs: the output constrained to a JSON schema, a regex, a choice or a grammar.

xgrammar compiles the constraint against the model's vocabulary once (an automaton whose
token masks are mostly precomputed) and keeps a matcher per request; each step the matcher's
mask of allowed next tokens goes into that request's logits row (`mask_logits`) and the sampled
token advances it (`RequestGrammar.accept`). This is what vLLM and SGLang use by default.

A request's grammar state is a function of its output tokens only, so a decode worker that
receives a prefill worker's first token, or a request resumed elsewhere, rebuilds it by
accepting the tokens it already has. Its next mask needs its previous token on the host: under
async scheduling the engine queues step n+1's forward pass first, then finishes step n (its
tokens reach the host, the grammars advance), then fills the masks and queues the sampling
(`ModelRunner.launch`'s `settle`), so the host work still overlaps the device's. It does not
speculate. The masks are applied by `engine.sampler.mask_logits`.

A thinking model reasons first and answers in the language after its `</think>` token (the
request's `reasoning_end_token_id`, which the gateway's reasoning parser sets, as vLLM's
reasoning-aware structured outputs do): until then its rows are not masked.

xgrammar (which imports transformers) is imported on the first structured request, off the
engine thread where the services call it (`AsyncEngine` compiles in a worker thread). A new
constraint is first tried in a child process under a deadline, and refused when it compiles
too slowly or its token masks would stall the engine's steps (engine/grammar_vetting.py).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from engine.grammar_vetting import GrammarLimits, GrammarVetting
from engine.grammar_vetting import prestart as prestart_vetting
from engine.utf8_state import BOUNDARY, Utf8Table
from engine_api.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    from collections.abc import Sequence

    from engine_api.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Compiled grammars kept (xgrammar keeps its own cache too; this one also skips re-parsing the
# key's text). A JSON schema's compiled form is ~10-100 KB.
_COMPILED_CACHE = 256


class StructuredOutputError(ValueError):
    """A constraint that does not compile, or tokens the constraint does not accept."""


# Raw C0 control characters JSON never allows (RFC 8259: escaped inside strings; outside them
# only space, \t, \n, \r). xgrammar 0.2.9 lets them into strings bounded by minLength /
# maxLength (mlc-ai/xgrammar#800, open), so tokens holding one are masked for every JSON
# constraint. \t goes too: that rule admits a raw tab inside such strings, and outside them it
# is only optional whitespace. \n and \r stay (that rule excludes them).
_JSON_FORBIDDEN_BYTES = re.compile(rb"[\x00-\x09\x0b\x0c\x0e-\x1f]")


class RequestGrammar:
    """One request's position in its constraint's language, and in UTF-8 (engine/utf8_state.py).

    For a thinking model the language may start later (`StructuredOutputs`'
    `reasoning_end_token_id`): until that token the output is free — its rows are not masked
    (`active`) and its tokens do not reach the matcher — and the language starts right after it.
    With a start token too, the first token may be that one (it opens the free part) or one
    the language allows."""

    __slots__ = ("_end", "_masks", "_matcher", "_phase", "_start", "_state", "_utf8", "failed")

    def __init__(self, matcher: Any, masks: Sequence[torch.Tensor], utf8: Utf8Table,
                 reasoning_end: int | None = None, reasoning_start: int | None = None) -> None:
        """masks: per UTF-8 state, int32 bitmask words of the tokens the constraint may use
        from it, ANDed into the grammar's mask."""
        self._matcher = matcher
        self._masks = masks
        self._utf8 = utf8
        self._state = BOUNDARY
        self._end = reasoning_end
        self._start = reasoning_start
        # "on": in the language; "free": reasoning, until `_end`; "first": the next token is
        # the output's first, and `_start` may open reasoning.
        self._phase = ("on" if reasoning_end is None
                       else "free" if reasoning_start is None else "first")
        self.failed = False  # a token was sampled that the grammar rejects (see `accept`)

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (False while the model reasons)."""
        return self._phase != "free"

    @property
    def allowed(self) -> torch.Tensor:
        """The static mask for the next token (the constraint's, at this UTF-8 state)."""
        return self._masks[self._state]

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and `failed`) when the grammar rejects it or it
        leaves ill-formed UTF-8, which the masks rule out unless the logits row had no
        allowed token left (NaN logits)."""
        if self.failed:
            return False
        if self._phase == "first":  # the output's first token: it opens reasoning, or not
            if token_id == self._start:
                self._phase = "free"
                return True
            self._phase = "on"
        if self._phase == "free":  # reasoning: the language starts after its end token
            if token_id == self._end:
                self._phase = "on"
            return True
        state = self._utf8.advance(self._state, token_id)
        ok = state >= 0 and bool(self._matcher.accept_token(token_id))
        if ok:
            self._state = state
        else:
            self.failed = True
        return ok

    @property
    def is_terminated(self) -> bool:
        """The string is complete and a stop token was accepted: nothing may follow."""
        return self._phase == "on" and bool(self._matcher.is_terminated())


def fill_masks(grammars: Sequence[RequestGrammar], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` (int32 words, bit t of word w allows token 32 w + t) ← grammar i's
    allowed next tokens, ANDed with its static mask (the
    constraint's, at its UTF-8 state): once for all rows when they share it (the usual batch: an AND per row took 2.5 ms of
    host time at 256 rows on the H200, advanced indexing as long on the CPU), else row by row.
    Filled on this thread: xgrammar's `BatchGrammarMatcher` took ~4 ms even for one row there
    (bench/results/h200/structured/). Every grammar is `active`; one at its output's first
    token with a reasoning start token also allows that token."""
    opening: list[tuple[int, int]] = []  # (row, start token) of outputs that may open reasoning
    for row, g in enumerate(grammars):
        g._matcher.fill_next_token_bitmask(bitmask, row)
        if g._phase == "first" and g._start is not None:
            opening.append((row, g._start))
    masks = {id(g.allowed): g.allowed for g in grammars}
    if len(masks) == 1:
        [allowed] = masks.values()
        bitmask[:len(grammars)] &= allowed
    else:
        for row, g in enumerate(grammars):
            bitmask[row] &= g.allowed
    for row, start in opening:  # after the ANDs: the start token is not the language's
        word, bit = divmod(start, 32)
        bitmask[row, word] |= _bit_word(bit)


def _bit_word(bit: int) -> int:
    """The int32 word with only `bit` (0..31) set, as a signed value (bit 31 is the sign)."""
    return -(1 << 31) if bit == 31 else 1 << bit


def _compile_structural_tag(compiler: Any, text: str) -> Any:
    """vLLM's two forms of a structural tag: xgrammar's own (`{"type": "structural_tag",
    "format": ...}`, compiled as is), or the older structures and triggers (each structure's
    schema a JSON schema, as an object or its text)."""
    import xgrammar as xgr

    tag = json.loads(text)
    if not isinstance(tag, dict):
        raise StructuredOutputError("structured_outputs.structural_tag must be a JSON object")
    if "structures" not in tag:
        return compiler.compile_structural_tag(text)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) \
            or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise StructuredOutputError("structured_outputs.structural_tag: structures and triggers "
                                    "must be non-empty lists (triggers of non-empty strings)")
    items = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise StructuredOutputError(f"structured_outputs.structural_tag.structures[{i}] "
                                        "needs begin and end strings and a schema")
        schema = s.get("schema")
        schema_text = schema if isinstance(schema, str) else json.dumps(schema)
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=schema_text, end=s["end"]))
    return compiler.compile_structural_tag(items, triggers)


class GrammarCompiler:
    """Compiles constraints against one model's vocabulary; thread-safe."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 stop_token_ids: Sequence[int], limits: GrammarLimits | None = None) -> None:
        """limits: what a constraint may cost to compile and to mask a step with
        (engine/grammar_vetting.py)."""
        self._tokenizer = tokenizer
        self._limits = limits or GrammarLimits()
        self._vetting: GrammarVetting | None = None
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        # Per UTF-8 state, the tokens any constraint / a JSON one may use (_make_compiler).
        self._masks: dict[bool, list[torch.Tensor]] = {}
        self._utf8: Utf8Table | None = None
        self._compiled: OrderedDict[StructuredOutputs, Any] = OrderedDict()

    def grammar(self, spec: StructuredOutputs, output_token_ids: Sequence[int] = ()
                ) -> RequestGrammar:
        """A matcher at the start of `spec`'s output (its language, or the reasoning before it),
        advanced by tokens already generated (a decode worker's first token from prefill, a
        resumed request's outputs)."""
        import xgrammar as xgr

        compiled = self.compile(spec.constraint)
        assert self._utf8 is not None  # made with the compiler
        is_json = spec.json is not None or spec.json_object
        grammar = RequestGrammar(xgr.GrammarMatcher(compiled), self._masks[is_json], self._utf8,
                                 spec.reasoning_end_token_id, spec.reasoning_start_token_id)
        for i, token in enumerate(output_token_ids):
            if not grammar.accept(token):
                raise StructuredOutputError(
                    f"output_token_ids[{i}] = {token} is not allowed by structured_outputs "
                    f"({spec.kind}) after the tokens before it")
        return grammar

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled constraint (cached); raises StructuredOutputError naming the field."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > _COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> Any:
        compiler = self._xgrammar_compiler()
        if spec.choice is None and not spec.json_object:  # those two are bounded by their form
            assert self._vetting is not None  # made with the compiler
            problem = self._vetting.vet(spec)  # in a child process, under a deadline
            if problem is not None:
                raise StructuredOutputError(problem)
        return compile_spec(compiler, spec)

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise StructuredOutputError(
                        "structured_outputs needs the model's tokenizer, and this engine has none")
                prestart_vetting()  # its imports run while the compiler is made here
                self._compiler, self._masks, self._utf8, vocab, metadata = _make_compiler(
                    self._tokenizer, self.vocab_size, self._stop_token_ids)
                self._vetting = GrammarVetting(vocab, metadata, self._limits)
            return self._compiler


def compile_spec(compiler: Any, spec: StructuredOutputs) -> Any:
    """`spec` compiled by an xgrammar `GrammarCompiler`; raises StructuredOutputError naming the
    field when it does not compile."""
    field = f"structured_outputs.{spec.kind}"
    try:
        if spec.json is not None:
            json.loads(spec.json)  # xgrammar's message for bad JSON names no position
            return compiler.compile_json_schema(spec.json, any_whitespace=spec.any_whitespace)
        if spec.json_object:  # OpenAI's JSON mode: an object (vLLM's reading too)
            return compiler.compile_json_schema('{"type": "object"}',
                                                any_whitespace=spec.any_whitespace)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar(choice_grammar(spec.choice))
        if spec.structural_tag is not None:
            return _compile_structural_tag(compiler, spec.structural_tag)
        assert spec.grammar is not None
        return compiler.compile_grammar(spec.grammar)
    except StructuredOutputError:
        raise
    except ValueError as e:  # json.JSONDecodeError
        raise StructuredOutputError(f"{field} is not valid JSON: {e}") from None
    except RuntimeError as e:  # xgrammar's parse errors: "[time] file.cc:line: message"
        raise StructuredOutputError(f"{field} does not compile: {_xgrammar_message(e)}"
                                    ) from None


def _make_compiler(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]
                   ) -> tuple[Any, dict[bool, list[torch.Tensor]], Utf8Table, list[str], str]:
    """The compiler over the vocabulary; per UTF-8 state the bitmask of the tokens any
    constraint (False) and a JSON one (True) may use; the UTF-8 table; the vocabulary as the
    compiler reads it (each token's text, special ones empty) and its metadata."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    # xgrammar reads the vocabulary's encoding (byte-level, byte-fallback) from the HF form.
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    detected = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
    # Special tokens ("<|im_start|>") must never appear inside a constrained string, but a
    # byte-level vocabulary spells them in printable characters that xgrammar would take for
    # text; as empty strings they count as special and are never allowed (the stop tokens
    # still end a complete string). Ids beyond the tokenizer's (padding rows of the LM head)
    # stay empty as well.
    vocab: list[str] = [""] * vocab_size
    for text, i in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = text
    for i in tokenizer.all_special_ids:
        if i < vocab_size:
            vocab[i] = ""
    metadata = detected.dump_metadata()
    info = xgr.TokenizerInfo.from_vocab_and_metadata(list[bytes | str](vocab), metadata)
    logger.info("structured outputs: xgrammar over %d tokens (%s), stop tokens %s",
                vocab_size, info.vocab_type.name, info.stop_token_ids)
    decoded: list[bytes] = info.decoded_vocab
    utf8 = Utf8Table(decoded, vocab_size)
    json_usable = torch.ones(utf8.valid.shape[1], dtype=torch.bool)
    json_usable[[i for i, text in enumerate(decoded) if _JSON_FORBIDDEN_BYTES.search(text)]] = False
    masks = {False: [pack_bits(v) for v in utf8.valid],
             True: [pack_bits(v & json_usable) for v in utf8.valid]}
    return xgr.GrammarCompiler(info, max_threads=2), masks, utf8, vocab, metadata


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """[32 k] booleans → k int32 words, bit t of word w = flags[32 w + t] (xgrammar's layout)."""
    words = (flags.view(-1, 32).long() << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose strings are exactly `choices` (JSON string escapes are also
    EBNF's: quotes, backslashes, control characters, \\uXXXX)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _xgrammar_message(e: Exception) -> str:
    text = str(e).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
