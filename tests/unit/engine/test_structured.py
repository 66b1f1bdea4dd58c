"""Structured outputs in the engine (real SmolLM2, real xgrammar): every output is a string of
the asked language — JSON schema, any JSON object, regex, choice, EBNF grammar — greedy and
sampled, in batches with free-text requests (which must not change), with async scheduling,
rebuilt from tokens already generated (a decode worker's or a resumed request's), and refused
with a clear error when the constraint does not compile."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.grammar_vetting import GrammarLimits
from engine.request import Request
from engine.sampler import mask_logits
from engine.structured import GrammarCompiler, choice_grammar, pack_bits
from engine.utf8_state import BOUNDARY
from engine.utf8_state import step as utf8_step
from engine_api.errors import EngineInputError
from engine_api.sampling_params import SamplingParamsError, StructuredOutputs
from engine_api.tokenizer import _bytes_to_unicode

pytestmark = pytest.mark.slow

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON."}]


def _check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "pet"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert value["pet"] in ("cat", "dog", "none")


def _params(spec: StructuredOutputs, **kw: object) -> SamplingParams:
    opts: dict[str, object] = {"temperature": 0.0, "max_tokens": 96} | kw
    return SamplingParams(structured_outputs=spec, **opts)  # type: ignore[arg-type]


def test_json_schema_greedy_and_sampled(smollm2: LLM) -> None:
    spec = StructuredOutputs(json=json.dumps(PERSON))
    [greedy] = smollm2.chat(ASK_PERSON, _params(spec))
    [sampled] = smollm2.chat(ASK_PERSON, _params(spec, temperature=1.0, top_p=0.95, n=4, seed=7))
    for out in [*greedy.outputs, *sampled.outputs]:
        assert out.finish_reason == "stop", out
        _check_person(out.text)
    # The constraint changed what the model says: unconstrained, it does not answer in JSON.
    [free] = smollm2.chat(ASK_PERSON, SamplingParams(temperature=0.0, max_tokens=20))
    with pytest.raises(ValueError):
        _check_person(free.outputs[0].text)


@pytest.mark.parametrize(("spec", "check", "prompt"), [
    (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict),
     "A JSON object with a city's name:"),
    (StructuredOutputs(regex=r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t),
     "My phone number is"),
    (StructuredOutputs(choice=("yes", "no", 'say "maybe"\n')),
     lambda t: t in ("yes", "no", 'say "maybe"\n'), "Answer: is the sky blue?"),
    (StructuredOutputs(grammar='root ::= ("red" | "green") " " [0-9]{1,3} ("," [0-9]{1,3}){0,3}'),
     lambda t: re.fullmatch(r"(red|green) \d{1,3}(,\d{1,3}){0,3}", t), "A color and numbers:"),
], ids=["json_object", "regex", "choice", "grammar"])
def test_each_kind_of_constraint(smollm2: LLM, spec: StructuredOutputs, check: object,
                                 prompt: str) -> None:
    params = [_params(spec), _params(spec, temperature=0.9, seed=3)]
    for out in smollm2.generate([prompt, prompt], params):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (text, out.outputs[0])
        assert callable(check) and check(text), text


TOOL_X = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
          "additionalProperties": False}


def test_structural_tags(smollm2: LLM) -> None:
    """vLLM's structural tag, both forms. xgrammar's `format` (here a sequence: a tag, a JSON
    part, a closing tag) constrains the whole output; the older structures and triggers leave
    text free until a trigger, then hold the tagged part to its schema."""
    whole = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<tool>"},
        {"type": "json_schema", "json_schema": TOOL_X},
        {"type": "const_string", "value": "</tool>"}]}}
    [out] = smollm2.generate("Call the tool with x = 5:", _params(
        StructuredOutputs(structural_tag=json.dumps(whole))))
    text = out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop", text
    m = re.fullmatch(r"<tool>(.*)</tool>", text, re.S)
    assert m is not None and type(json.loads(m.group(1))["x"]) is int, text
    legacy = {"type": "structural_tag", "triggers": ["<tool>"], "structures": [
        {"begin": "<tool>", "schema": TOOL_X, "end": "</tool>"}]}
    tok = smollm2.engine.tokenizer
    assert tok is not None

    def accepts(text: str) -> bool:
        g = smollm2.engine.grammars.grammar(StructuredOutputs(structural_tag=json.dumps(legacy)))
        return all(g.accept(t) for t in tok.encode(text, add_special_tokens=False))

    assert accepts('Sure. <tool>{"x": 5}</tool> Done.')
    assert not accepts('Sure. <tool>{"y": "a"}')
    with pytest.raises(EngineInputError, match="structural_tag does not compile"):
        smollm2.generate("Hi", _params(StructuredOutputs(structural_tag='{"type": "x"}')))
    with pytest.raises(EngineInputError, match="structures and triggers"):
        smollm2.generate("Hi", _params(StructuredOutputs(
            structural_tag='{"structures": [], "triggers": []}')))


def test_choice_grammar_escapes() -> None:
    assert choice_grammar(['a"b', "c\\d", "é\n"]) == 'root ::= "a\\"b" | "c\\\\d" | "é\\n"'


def test_json_in_one_layout_without_whitespace(smollm2: LLM) -> None:
    """Random prompts: with any whitespace allowed this model spends its tokens on newlines
    (measured: no output of 32 tokens ended); in the fixed layout every one ends, compact."""
    spec = StructuredOutputs(json=json.dumps(PERSON), any_whitespace=False)
    prompts = [[(37 * i + 11 * j) % 40000 + 100 for j in range(16)] for i in range(3)]
    outs = smollm2.generate([{"prompt_token_ids": p} for p in prompts],
                            _params(spec, max_tokens=40))
    for out in outs:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        _check_person(text)
        assert text == json.dumps(json.loads(text)), text  # one layout: json.dumps's


def test_truncated_by_max_tokens(smollm2: LLM) -> None:
    [out] = smollm2.chat(ASK_PERSON, _params(StructuredOutputs(json=json.dumps(PERSON)),
                                             max_tokens=5))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].text.startswith("{")


def test_special_tokens_never_inside_a_string(smollm2: LLM) -> None:
    """A byte-level vocabulary spells "<|im_start|>" in printable characters; it is a control
    token and must never be allowed as text, and EOS only once the string is complete."""
    engine = smollm2.engine
    tok = engine.tokenizer
    assert tok is not None
    grammar = engine.grammars.grammar(StructuredOutputs(json_object=True),
                                      tok.encode('{"a": "', add_special_tokens=False))
    req = Request("r", [1, 2], _params(StructuredOutputs(json_object=True)))
    req.grammar = grammar
    logits = torch.zeros(1, engine.model_config.vocab_size)
    allowed = torch.isfinite(mask_logits(logits, [req])[0])
    assert allowed.sum() > 1000  # a string's content: most of the vocabulary
    assert not allowed[tok.all_special_ids].any()
    for token in tok.encode('b"}', add_special_tokens=False):
        assert grammar.accept(token)
    allowed = torch.isfinite(mask_logits(torch.zeros_like(logits), [req])[0])
    # Complete: whitespace may follow the object, then EOS ends it.
    assert allowed[list(engine.eos_token_ids)].all()
    assert not allowed[tok.encode("x", add_special_tokens=False)].any()
    assert grammar.accept(engine.eos_token_ids[0]) and grammar.is_terminated


@pytest.mark.parametrize("favoured", ["control", "high_bytes"])
def test_json_never_holds_raw_control_characters(smollm2: LLM, favoured: str) -> None:
    """An adversarial 'model' that prefers tokens holding C0 control characters (xgrammar
    0.2.9 admits them raw into strings bounded by maxLength, mlc-ai/xgrammar#800, which strict
    JSON parsers refuse), or single bytes 0x80-0xFF (spelled byte by byte, xgrammar takes some
    ill-formed UTF-8 for one character, which decoders replace by several): every walk must
    still parse, match the schema and decode without replacement characters."""
    engine = smollm2.engine
    tok = engine.tokenizer
    assert tok is not None
    vocab = engine.model_config.vocab_size
    if favoured == "control":
        control = [i for i in range(vocab)
                   if any(ord(c) < 32 and c not in "\n\r" for c in tok.decode([i]))]
    else:
        spell = _bytes_to_unicode()
        control = [i for b in range(0x80, 0x100)
                   if (i := tok.backend.token_to_id(spell[b])) is not None]
    assert len(control) > 20  # the byte tokens, tabs, ...
    spec = StructuredOutputs(json=json.dumps(PERSON), any_whitespace=False)  # bounded walks
    gen = torch.Generator().manual_seed(0)
    for walk in range(12):
        req = Request(f"w{walk}", [1], _params(spec))
        req.grammar = engine.grammars.grammar(spec)
        ids: list[int] = []
        while not (req.grammar.is_terminated or len(ids) > 200):
            logits = torch.randn(1, vocab, generator=gen)
            logits[0, control] += 8.0
            token = int(mask_logits(logits, [req]).argmax())
            assert req.grammar.accept(token), (walk, ids)
            ids.append(token)
        text = tok.decode([t for t in ids if t not in engine.eos_token_ids])
        assert "\ufffd" not in text, text
        _check_person(text)


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=1, max_size=7).map(
    lambda b: bytes(x if x & 0x80 else x | 0x80 for x in b)))
@example(b"\xed\xa0")  # a surrogate's first two bytes: Python's incremental decoder waits
def test_utf8_state_agrees_with_the_decoder(data: bytes) -> None:
    """`engine.utf8_state` against Python's decoder: complete at a boundary iff the bytes
    decode, alive iff they are a prefix of well-formed UTF-8 (high bytes only, where the
    ill-formed cases are: surrogates, overlongs, beyond U+10FFFF, lone continuations)."""
    state = BOUNDARY
    for byte in data:
        state = utf8_step(state, byte) if state >= 0 else -1
    try:
        data.decode("utf-8")
        whole = True
    except UnicodeDecodeError:
        whole = False
    # A prefix of well-formed UTF-8 iff some completion decodes. Python's incremental decoder
    # is no oracle here: it holds `ed a0` back as pending and rejects the surrogate only at the
    # third byte. Only a character's first continuation byte has a restricted range (RFC 3629),
    # so completing with each first byte, then 80s, tries every case.
    tails = [b""] + [bytes([first]) + b"\x80" * extra
                     for first in range(0x80, 0xC0) for extra in range(3)]
    prefix = any(_decodes(data + tail) for tail in tails)
    assert (state == BOUNDARY) == whole and (state >= 0) == prefix, (data.hex(" "), state)


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_utf8_known_sequences() -> None:
    def walk(hexes: str) -> int:
        state = BOUNDARY
        for byte in bytes.fromhex(hexes):
            state = utf8_step(state, byte) if state >= 0 else -1
        return state
    assert walk("ed 9f bf") == BOUNDARY and walk("ed a0 80") == -1  # U+D7FF; a surrogate
    assert walk("e0 80 80") == -1 and walk("c0 80") == -1  # overlong
    assert walk("f4 8f bf bf") == BOUNDARY and walk("f4 90 80 80") == -1  # U+10FFFF; beyond
    assert walk("f0 9f 98") > BOUNDARY  # three bytes of an emoji: one still owed


def test_pack_bits_is_the_unpacked_layout() -> None:
    flags = torch.rand(96, generator=torch.Generator().manual_seed(3)) < 0.5
    flags[31] = flags[63] = True  # the sign bits
    words = pack_bits(flags)
    bits = torch.arange(32, dtype=torch.int32)
    assert words.dtype == torch.int32
    assert torch.equal(((words[:, None] >> bits) & 1).bool().flatten(), flags)


def test_mask_touches_only_constrained_rows(smollm2: LLM) -> None:
    engine = smollm2.engine
    spec = StructuredOutputs(choice=("yes", "no"))
    free, constrained = (Request(name, [1], _params(spec)) for name in ("a", "b"))
    free.sampling_params = SamplingParams(temperature=0.0)
    constrained.grammar = engine.grammars.grammar(spec)
    logits = torch.randn(3, engine.model_config.vocab_size)
    want = logits.clone()
    out = mask_logits(logits, [free, constrained, free])
    assert torch.equal(out[0], want[0]) and torch.equal(out[2], want[2])
    finite = torch.isfinite(out[1]).nonzero().flatten().tolist()
    tok = engine.tokenizer
    assert tok is not None
    # Exactly the tokens that start "yes" or "no".
    assert {tok.decode([t]) for t in finite} <= {"y", "ye", "yes", "n", "no"}, finite
    assert torch.equal(out[1, finite], want[1, finite])


def test_mixed_batch_sync_and_async(smollm2: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Constrained and free requests in one batch: the free ones' tokens are those they get
    alone, and async scheduling (which waits for a constrained request's token before
    sampling its next) gives the same tokens as synchronous."""
    spec = StructuredOutputs(json=json.dumps(PERSON))
    prompts = ["The weather today is", "Describe a person as JSON:", "Once upon a time",
               "JSON for a person:"]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [free, _params(spec), free, _params(spec, temperature=1.0, seed=11)]
    alone = [o.outputs[0].token_ids for o in smollm2.generate(prompts[::2], free)]
    sync = smollm2.generate(prompts, params)
    monkeypatch.setattr(smollm2.engine, "async_scheduling", True)
    asynced = smollm2.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in asynced] == [o.outputs[0].token_ids for o in sync]
    assert [sync[0].outputs[0].token_ids, sync[2].outputs[0].token_ids] == alone
    for out in (sync[1], sync[3]):
        _check_person(out.outputs[0].text)


def test_rebuilt_from_output_tokens(smollm2: LLM) -> None:
    """A decode worker gets the first token from prefill; a resumed request its outputs so
    far: the grammar is advanced by them, and the rest is what one engine would have made."""
    engine = smollm2.engine
    spec = StructuredOutputs(json=json.dumps(PERSON))
    [whole] = smollm2.chat(ASK_PERSON, _params(spec))
    tokens = whole.outputs[0].token_ids
    prompt = whole.prompt_token_ids
    engine.add_request("resumed", prompt, _params(spec), output_token_ids=tokens[:4])
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for step in engine.step():
            rest += step.new_token_ids
    assert tokens[:4] + rest == tokens
    bad = smollm2.engine.tokenizer.encode("hello", add_special_tokens=False)  # type: ignore[union-attr]
    with pytest.raises(EngineInputError, match=r"output_token_ids\[0\].*not allowed"):
        engine.add_request("bad", prompt, _params(spec), output_token_ids=bad)
    assert not engine.scheduler.requests


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputs(json='{"type": "object",'), r"structured_outputs\.json is not valid JSON"),
    (StructuredOutputs(json='{"type": "objectx"}'), r"structured_outputs\.json does not compile"),
    (StructuredOutputs(regex="(ab"), r"structured_outputs\.regex does not compile.*parenthesis"),
    (StructuredOutputs(grammar="root ::= foo"), r"grammar does not compile.*foo"),
])
def test_bad_constraints_refused(smollm2: LLM, spec: StructuredOutputs, message: str) -> None:
    with pytest.raises(EngineInputError, match=message):
        smollm2.generate("Hi", _params(spec))
    assert not smollm2.engine.scheduler.requests


def test_params_validation() -> None:
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("a",))
    with pytest.raises(SamplingParamsError, match="choice"):
        StructuredOutputs(choice=())
    with pytest.raises(SamplingParamsError, match="choice"):
        StructuredOutputs(choice=("a", ""))
    with pytest.raises(SamplingParamsError, match="regex"):
        StructuredOutputs(regex="x" * ((1 << 17) + 1))
    spec = StructuredOutputs(regex="a+")
    with pytest.raises(SamplingParamsError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=spec)
    with pytest.raises(SamplingParamsError, match="allowed_token_ids cannot be combined"):
        SamplingParams(allowed_token_ids=[1], structured_outputs=spec)
    assert StructuredOutputs(choice=["a"]).choice == ("a",)  # hashable: the compile cache's key


# -- a thinking model: the language after its reasoning ------------------------------------------
def test_language_starts_after_the_reasoning_end_token(smollm2: LLM,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to and including `reasoning_end_token_id` the output is the model's own (one of its
    greedy tokens stands in for </think>), then in the language; with a start token, a first
    token that is it opens the free part, any other means the language from the first token.
    Async scheduling (the free part ends on the previous step's token) gives the same."""
    def ids(spec: StructuredOutputs | None) -> list[int]:
        params = (SamplingParams(temperature=0.0, max_tokens=8) if spec is None
                  else _params(spec, max_tokens=16))
        [out] = smollm2.chat(ASK_PERSON, params)
        assert spec is None or out.outputs[0].finish_reason == "stop"
        return out.outputs[0].token_ids

    free = ids(None)
    i = next(k for k in range(3, len(free)) if free[k] not in free[:k])
    plain = StructuredOutputs(regex=r"[0-9]{3}")
    gated = dataclasses.replace(plain, reasoning_end_token_id=free[i])
    out = ids(gated)
    tok = smollm2.engine.tokenizer
    assert tok is not None
    assert out[:i + 1] == free[:i + 1]
    assert re.fullmatch(r"[0-9]{3}", tok.decode(out[i + 1:])), tok.decode(out)
    assert ids(dataclasses.replace(gated, reasoning_start_token_id=free[0])) == out
    unopened = ids(dataclasses.replace(gated, reasoning_start_token_id=tok.bos_token_id or 1))
    assert unopened == ids(plain) != out
    monkeypatch.setattr(smollm2.engine, "async_scheduling", True)
    assert ids(gated) == out


def test_reasoning_gate_masks_and_rebuilds(smollm2: LLM) -> None:
    """The masks through each phase (the start token's bit is the word's sign bit here), and a
    grammar rebuilt from output tokens in each phase; tokens after the end token that the
    language refuses are refused."""
    engine = smollm2.engine
    tok = engine.tokenizer
    assert tok is not None
    start, end = 31, tok.encode("!", add_special_tokens=False)[0]
    spec = StructuredOutputs(json_object=True, reasoning_end_token_id=end,
                             reasoning_start_token_id=start)
    req = Request("r", [1, 2], _params(spec))
    req.grammar = grammar = engine.grammars.grammar(spec)

    def allowed() -> torch.Tensor:
        return torch.isfinite(mask_logits(torch.zeros(1, engine.model_config.vocab_size),
                                          [req])[0])

    first = allowed()
    assert first[start] and first[tok.encode("{", add_special_tokens=False)].all()
    assert not first[end] and first.sum() < 100
    for token in (start, *tok.encode("I think", add_special_tokens=False)):
        assert grammar.accept(token) and grammar.active is False
        assert allowed().all()  # reasoning: the row is the model's
    assert grammar.accept(end) and grammar.active
    after = allowed()
    assert not after[start] and not after[end] and after.sum() < 100
    reasoned = [start, *tok.encode("Hm", add_special_tokens=False), end]
    answer = tok.encode('{"a": 1}', add_special_tokens=False)
    whole = engine.grammars.grammar(spec, [*reasoned, *answer, engine.eos_token_ids[0]])
    assert whole.is_terminated
    assert engine.grammars.grammar(spec, answer).active  # no start token: the language at once
    bad = tok.encode("hello", add_special_tokens=False)
    with pytest.raises(EngineInputError, match=rf"output_token_ids\[{len(reasoned)}\]"):
        engine.add_request("bad", [1, 2], _params(spec), output_token_ids=[*reasoned, *bad])
    assert not engine.scheduler.requests


def test_reasoning_gate_validation(smollm2: LLM) -> None:
    with pytest.raises(SamplingParamsError, match="reasoning_start_token_id needs"):
        StructuredOutputs(json_object=True, reasoning_start_token_id=5)
    with pytest.raises(SamplingParamsError, match="reasoning_start_token_id needs"):
        StructuredOutputs(json_object=True, reasoning_end_token_id=5, reasoning_start_token_id=5)
    with pytest.raises(SamplingParamsError, match="reasoning_end_token_id must be a token id"):
        StructuredOutputs(json_object=True, reasoning_end_token_id=-1)
    vocab = smollm2.engine.model_config.vocab_size
    spec = StructuredOutputs(json_object=True, reasoning_end_token_id=vocab)
    with pytest.raises(EngineInputError, match=rf"reasoning tokens name token ids outside .*\[{vocab}\]"):
        smollm2.generate("Hi", _params(spec))
    # The language is compiled once, wherever it starts.
    assert spec.constraint == StructuredOutputs(json_object=True)


@pytest.mark.parametrize("spec", [
    StructuredOutputs(json='{"type": "object"}', any_whitespace=False, reasoning_end_token_id=7),
    StructuredOutputs(choice=("a", "b"), reasoning_end_token_id=7, reasoning_start_token_id=0),
    StructuredOutputs(regex="a+"),
])
def test_wire_round_trip(spec: StructuredOutputs) -> None:
    """The gateway writes a constraint and where it starts; the workers (and the gateway's own
    gRPC front door) read back the same."""
    from gateway.structured import structured_from_proto as from_client
    from gateway.structured import structured_to_proto
    from protos.splitserve.v1 import common_pb2
    from worker.convert import structured_from_proto as from_gateway

    proto = common_pb2.SamplingParams()
    structured_to_proto(spec, proto.structured_outputs)
    assert from_gateway(proto) == spec == from_client(proto)


def _chained_grammar(n: int) -> str:
    rules = "\n".join(f'r{i} ::= "a" | "b" | r{i + 1}' for i in range(n))
    return "root ::= " + " ".join(f"r{i}" for i in range(n)) + f"\n{rules}\nr{n} ::= \"c\"\n"


def test_a_constraint_that_compiles_too_long_is_refused_in_time(smollm2: LLM) -> None:
    """Compiling is bounded: the vetting child is killed at the deadline (2,000 chained rules
    compile for minutes) and the request refused within it."""
    tok = smollm2.engine.tokenizer
    assert tok is not None
    compiler = GrammarCompiler(tok, smollm2.engine.grammars.vocab_size,
                               smollm2.engine.eos_token_ids,
                               GrammarLimits(compile_timeout_s=0.5))
    compiler.compile(StructuredOutputs(regex="[a-z]+"))  # the child started (not timed)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"did not compile within 0\.5 s"):
        compiler.compile(StructuredOutputs(grammar=_chained_grammar(2000)))
    assert time.monotonic() - start < 5.0
    # (A grammar refused for its first mask's cost: tests/e2e/test_e2e_structured.py.)
