"""Sampler semantics on made-up logits (no model): greedy, seeds, top-k/top-p/min-p, penalties,
min_tokens, logprobs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.penalties import penalties_reference as apply_penalties
from engine.request import Request
from engine.sampler import Sampler, argmax_rows, filter_probs
from engine_api.sampling_params import SamplingParams

V = 32


def _req(rid: str = "r", prompt: list[int] | None = None, out: list[int] | None = None,
         eos: tuple[int, ...] = (), **sp: Any) -> Request:
    return Request(rid, prompt or [1, 2, 3], SamplingParams(**sp), eos_token_ids=eos,
                   output_token_ids=out)


def _logits(n: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(6)
    tokens, lps = Sampler()(logits, [_req(str(i), temperature=0.0) for i in range(6)])
    assert tokens == logits.argmax(-1).tolist()
    assert lps == [None] * 6


def _draws(req: Request, rows: list[torch.Tensor], others: list[Request], pos: int) -> list[int]:
    """Sample `req` once per row in `rows`, batched with `others` (req placed at index `pos`)."""
    sampler = Sampler()
    got = []
    for step, row in enumerate(rows):
        batch = list(others)
        batch.insert(pos, req)
        logits = _logits(len(batch), seed=1000 + step)
        logits[pos] = row
        tokens, _ = sampler(logits, batch)
        got.append(tokens[pos])
    return got


def test_seeded_sampling_reproducible_and_batch_independent() -> None:
    rows = list(_logits(20, seed=5) / 3)  # flat-ish distributions: draws really vary
    alone = _draws(_req(seed=1234), rows, [], 0)
    again = _draws(_req(seed=1234), rows, [], 0)
    others = [_req("x", seed=99), _req("y"), _req("z", temperature=0.0), _req("w", top_k=3)]
    batched = _draws(_req(seed=1234), rows, others, 2)
    assert alone == again == batched
    assert len(set(alone)) > 3, "draws should vary"
    assert _draws(_req(seed=4321), rows, [], 0) != alone


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = _logits(64, seed=2)
    greedy = logits.argmax(-1).tolist()
    k1, _ = Sampler()(logits, [_req(str(i), temperature=1.5, top_k=1) for i in range(64)])
    p0, _ = Sampler()(logits, [_req(str(i), temperature=1.5, top_p=1e-6) for i in range(64)])
    assert k1 == greedy
    assert p0 == greedy


def test_top_k_top_p_min_p_keep_the_right_sets() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(-1)[0]  # ≈ .64 .23 .09 .03 .01 .004

    def kept(**sp: Any) -> list[int]:
        p = filter_probs(logits.clone(), [SamplingParams(**sp)])[0]
        torch.testing.assert_close(p.sum(), torch.tensor(1.0))
        return (p > 0).nonzero().flatten().tolist()

    assert kept(top_k=3) == [0, 1, 2]
    # Smallest prefix whose mass reaches top_p.
    assert kept(top_p=0.5) == [0]
    assert kept(top_p=float(probs[0]) + 0.01) == [0, 1]
    assert kept(top_p=float(probs[:3].sum()) + 0.001) == [0, 1, 2, 3]
    # min_p: tokens below min_p * max prob are dropped; the rest renormalised.
    assert kept(min_p=0.3) == [0, 1]
    p = filter_probs(logits.clone(), [SamplingParams(min_p=0.3)])[0]
    torch.testing.assert_close(p[:2], probs[:2] / probs[:2].sum())
    # Temperature sharpens before filtering.
    p_cold = filter_probs(logits.clone(), [SamplingParams(temperature=0.5)])[0]
    torch.testing.assert_close(p_cold, (logits[0] / 0.5).softmax(-1))


def test_sampling_follows_the_distribution() -> None:
    torch.manual_seed(0)
    row = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 4000
    tokens, _ = Sampler()(row.repeat(n, 1), [_req(str(i), temperature=1.0) for i in range(n)])
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    torch.testing.assert_close(freq, row.softmax(-1), atol=0.03, rtol=0)


def test_samples_stay_inside_filtered_sets() -> None:
    torch.manual_seed(1)
    logits = _logits(1, seed=3)[0]
    n = 500
    top3 = set(logits.topk(3).indices.tolist())
    tokens, _ = Sampler()(logits.repeat(n, 1), [_req(str(i), top_k=3) for i in range(n)])
    assert set(tokens) <= top3
    assert len(set(tokens)) > 1
    probs = logits.softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    tokens, _ = Sampler()(logits.repeat(n, 1), [_req(str(i), min_p=0.2) for i in range(n)])
    assert set(tokens) <= allowed


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0]])
    req = _req(prompt=[0, 1], out=[1], repetition_penalty=2.0)
    got = apply_penalties(logits.clone(), [req])
    # Seen tokens {0, 1} (prompt + output): positive logits divided, negative multiplied.
    torch.testing.assert_close(got, torch.tensor([[1.0, -4.0, 1.0, -1.0, 3.0]]))


def test_presence_and_frequency_penalties_openai_semantics() -> None:
    logits = torch.zeros(1, 5)
    # Prompt tokens do not count; output token 2 appears three times, 4 once.
    req = _req(prompt=[0, 0, 1], out=[2, 4, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits.clone(), [req])
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, -(0.5 + 3 * 0.25), 0.0,
                                                   -(0.5 + 0.25)]]))


def test_penalties_steer_greedy_and_leave_others_alone() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0], [5.0, 4.9, 0.0]])
    plain = _req("plain", prompt=[0], temperature=0.0)
    penal = _req("pen", prompt=[0], temperature=0.0, repetition_penalty=1.2)
    tokens, _ = Sampler()(logits.clone(), [plain, penal])
    assert tokens == [0, 1]


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # EOS (1) then stop id (2) are the top tokens
    early = _req(eos=(1,), temperature=0.0, min_tokens=2, max_tokens=5, stop_token_ids=[2])
    tokens, _ = Sampler()(logits, [early])
    assert tokens == [3]
    done = _req(out=[3, 3], eos=(1,), temperature=0.0, min_tokens=2, max_tokens=5)
    assert Sampler()(logits, [done])[0] == [1]
    ignore = _req(eos=(1,), temperature=0.0, min_tokens=2, max_tokens=5, ignore_eos=True)
    assert Sampler()(logits, [ignore])[0] == [1]  # ignore_eos: EOS is an ordinary token


def test_min_tokens_masks_each_row_its_own_ids() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0, 1.0]] * 3)
    reqs = [_req("a", eos=(1,), temperature=0.0, min_tokens=2, stop_token_ids=[2]),
            _req("b", eos=(1,), temperature=0.0),  # no min_tokens: EOS allowed
            _req("c", eos=(1,), temperature=0.0, min_tokens=3, stop_token_ids=[3, 99],
                 ignore_eos=True)]  # 99 is outside the vocabulary: skipped
    tokens, _ = Sampler()(logits, reqs)
    assert tokens == [3, 1, 1]


@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_sorted_and_match_log_softmax(n: int) -> None:
    logits = _logits(3, seed=7)
    reqs = [_req("a", temperature=0.0, logprobs=n), _req("b", logprobs=n, seed=3),
            _req("c", temperature=0.0, repetition_penalty=1.5, logprobs=n)]
    tokens, lps = Sampler()(logits.clone(), reqs)
    ref = logits.log_softmax(-1)  # raw model distribution, before penalties and filters
    for i, lp in enumerate(lps):
        assert lp is not None
        assert lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-5)
        assert len(lp.top) == n
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        want = ref[i].topk(n) if n else None
        if want is not None:
            assert [t for t, _ in lp.top] == want.indices.tolist()
            torch.testing.assert_close(torch.tensor(vals), want.values)
    _, lps2 = Sampler()(logits.clone(), [_req("d", temperature=0.0)])
    assert lps2 == [None]


@pytest.mark.parametrize("vocab", [128256, 49152, 1000])
def test_argmax_rows_is_torch_argmax(vocab: int) -> None:
    """Two-level argmax = torch's: random rows, ties (first index wins, also across chunks and
    inside one), NaN (wins), -inf rows, and a vocabulary no chunk divides (1000)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g)
    logits[1, :] = 0.0                                    # all tied: index 0
    logits[2, [7, vocab - 3, vocab // 2]] = 50.0           # ties in different chunks
    logits[3, [1030 % vocab, 1031 % vocab]] = 50.0        # ties inside one chunk
    logits[4, [vocab - 1]] = 50.0                         # the last index
    logits[5, [100, vocab - 5]] = float("nan")            # NaN wins, the first one
    logits[6, :] = float("-inf")
    logits[7, [vocab * 2 // 3]] = float("inf")
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.shape == (9,)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[1] == 0 and got[2] == 7 and got[4] == vocab - 1
    non_dense = logits[:, :-1]  # a view with padded rows falls back to torch
    assert torch.equal(argmax_rows(non_dense), non_dense.argmax(dim=-1))


def test_bf16_logits_greedy_on_them_and_everything_else_widened() -> None:
    """The CUDA graphs hand the sampler bf16 logits: an all-greedy batch takes its argmax on
    them (ties included: bf16 rounding makes them common); any other batch gets float32 logprobs
    of the widened logits and the same tokens as from float32 input."""
    logits = (_logits(6, seed=11, vocab=4096) * 4).to(torch.bfloat16)
    logits[2, [5, 900, 3000]] = 100.0  # tied maxima: the first index wins
    wide = logits.float()
    greedy = [_req(str(i), temperature=0.0) for i in range(6)]
    tokens, _ = Sampler()(logits, greedy)
    assert tokens == wide.argmax(-1).tolist() and tokens[2] == 5
    mixed = [_req("a", temperature=0.0, logprobs=2), _req("b", seed=9),
             _req("c", temperature=0.0, repetition_penalty=1.3, out=[7]), *greedy[3:]]
    got_tokens, got_lps = Sampler()(logits, mixed)
    want_tokens, want_lps = Sampler()(wide, mixed)
    assert got_tokens == want_tokens and got_lps == want_lps
    assert got_lps[0] is not None and isinstance(got_lps[0].logprob, float)


def test_logit_bias_adds_to_the_named_tokens_of_its_row_only() -> None:
    logits = _logits(3)
    low = int(logits[1].argmin())
    reqs = [_req("a", temperature=0.0), _req("b", temperature=0.0, logit_bias={low: 100.0}),
            _req("c", temperature=0.0, logit_bias={0: -100.0, 1: -100.0})]
    tokens, _ = Sampler()(logits.clone(), reqs)
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == low  # the least likely token, pushed to the top
    expected = logits[2].clone()
    expected[[0, 1]] -= 100.0
    assert tokens[2] == int(expected.argmax())


def test_logit_bias_on_bf16_logits_and_logprobs_stay_the_models() -> None:
    logits = _logits(2).to(torch.bfloat16)
    low = int(logits[0].float().argmin())
    pending = Sampler().sample(logits, [_req("a", temperature=0.0, logprobs=0,
                                             logit_bias={low: 100.0}),
                                        _req("b", temperature=0.0)])
    tokens, lps = pending.result()
    assert tokens == [low, int(logits[1].float().argmax())]
    raw = logits.float().log_softmax(-1)
    assert lps[0] is not None and lps[0].logprob == pytest.approx(float(raw[0, low]), abs=1e-5)


def test_allowed_token_ids_limit_greedy_and_random_rows() -> None:
    logits = _logits(4)
    allowed = [3, 17, 29]
    reqs = [_req("g", temperature=0.0, allowed_token_ids=allowed),
            _req("r", temperature=1.0, seed=1, allowed_token_ids=allowed),
            _req("free", temperature=0.0),
            _req("both", temperature=0.0, allowed_token_ids=[5, 6],
                 logit_bias={6: 100.0, 7: 100.0})]  # 7 is biased but not allowed
    sampler = Sampler()
    for _ in range(20):
        tokens, _ = sampler(logits.clone(), reqs)
        assert tokens[0] == max(allowed, key=lambda t: float(logits[0, t]))
        assert tokens[1] in allowed
        assert tokens[2] == int(logits[2].argmax())
        assert tokens[3] == 6


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
])
def test_logit_bias_and_allowed_token_ids_are_validated(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_token_ids_beyond_the_vocabulary_are_named() -> None:
    sp = SamplingParams(logit_bias={5: 1.0, 40: 2.0}, allowed_token_ids=[1, 33])
    assert sp.token_ids_beyond(32) == [33, 40]
    assert sp.token_ids_beyond(64) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_shaped_rows_on_the_gpu_match_the_cpu() -> None:
    """Bias and allow-lists scattered on the device (pinned index copies, no sync) pick what the
    CPU picks, on bf16 logits as the CUDA graphs hand them over."""
    logits = _logits(5).to(torch.bfloat16)
    reqs = [_req("a", temperature=0.0, logit_bias={3: 100.0, 4: -100.0}),
            _req("b", temperature=0.0, allowed_token_ids=[7, 9, 11]),
            _req("c", temperature=0.0),
            _req("d", temperature=0.0, logit_bias={int(logits[3].float().argmax()): -100.0}),
            _req("e", temperature=0.0, allowed_token_ids=[1, 2], logit_bias={2: 50.0})]
    cpu, _ = Sampler()(logits.clone(), reqs)
    gpu, _ = Sampler()(logits.cuda(), reqs)
    assert gpu == cpu and cpu[0] == 3 and cpu[4] == 2 and cpu[1] in (7, 9, 11)


def test_a_requests_shaping_tensors_are_made_once() -> None:
    req = _req(temperature=0.0, logit_bias={1: 1.0}, allowed_token_ids=[1, 2, 3])
    sampler = Sampler()
    sampler(_logits(1), [req])
    first = req.shaping_tensors
    sampler(_logits(1, seed=2), [req])
    assert first is not None and req.shaping_tensors is first


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_shaped_requests_through_the_engine(device: str) -> None:
    """Bias and allow-lists beside plain greedy requests; on the GPU in decode steps replayed
    from CUDA graphs with async scheduling (the sampler runs on the graphs' bf16 logits)."""
    from engine import LLM

    llm = LLM(model="dummy:tiny", device=device, max_model_len=256,
              dtype="bfloat16" if device == "cuda" else "float32",
              gpu_memory_utilization=0.05)
    if device == "cuda":
        assert llm.engine.async_scheduling and llm.engine.runner.graphs is not None
    prompts: list[Any] = [{"prompt_token_ids": [1 + i, 2, 3, 4 + i]} for i in range(6)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             logit_bias={77: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             allowed_token_ids=[5, 6, 7]),
              SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True,
                             allowed_token_ids=[300, 301]),
              plain, plain, plain]
    outs = llm.generate(prompts, params)
    alone = llm.generate(prompts[3:], [plain] * 3)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] == [77] * 12
    assert set(tokens[1]) <= {5, 6, 7} and set(tokens[2]) <= {300, 301}
    assert tokens[3:] == [o.outputs[0].token_ids for o in alone]  # neighbours untouched


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a GPU"))])
def test_penalty_state_matches_the_reference_step_by_step(device: str) -> None:
    """Requests join (some resumed with outputs), generate, finish and leave over many steps;
    slots are reused and the buffers grow past their first size. Every step, the batched
    device-resident penalties equal the row-by-row reference."""
    from engine.penalties import PenaltyState
    from engine.request import RequestStatus

    gen = torch.Generator().manual_seed(7)
    vocab = 48
    state = PenaltyState(vocab, torch.device(device))
    live: list[Request] = []
    made = 0
    for step in range(60):
        while len(live) < 4 + step % 13:  # up to 16 at once: past the first 8 slots
            kind = made % 4
            params: dict[str, Any] = [
                {"repetition_penalty": 1.3}, {"presence_penalty": 0.7, "frequency_penalty": 0.2},
                {"repetition_penalty": 0.8, "frequency_penalty": -0.5}, {}][kind]
            prompt = torch.randint(0, vocab + 3, (5,), generator=gen).tolist()  # some >= vocab
            out = torch.randint(0, vocab, (made % 3,), generator=gen).tolist()  # resumed ones
            live.append(_req(f"r{made}", prompt=prompt, out=out, **params))
            made += 1
        logits = (torch.randn(len(live), vocab, generator=gen) * 3).to(device)
        got = state.apply(logits.clone(), live)
        torch.testing.assert_close(got, apply_penalties(logits.clone(), live), rtol=0, atol=1e-6)
        for r in live:
            r.append_output_token(int(torch.randint(0, vocab, (1,), generator=gen)))
        for r in live[::5]:  # a few finish each step
            r.status = RequestStatus.FINISHED_STOPPED
        live = [r for r in live if not r.is_finished]
    assert state.counts.shape[0] == 16 and state.num_active <= 16


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a GPU"))])
def test_penalty_state_holds_to_its_capacity(device: str) -> None:
    """More live penalized requests than slots, each step sampling a window of at most
    `capacity` of them (the others preempted or not scheduled): the buffers never pass the
    capacity, slots move to the step's requests, and a request that lost its slot gets its
    counts back whole — every step equals the row-by-row reference."""
    from engine.penalties import PenaltyState

    gen = torch.Generator().manual_seed(11)
    vocab, capacity = 40, 5
    state = PenaltyState(vocab, torch.device(device), capacity=capacity)
    live = [_req(f"r{i}", prompt=torch.randint(0, vocab, (4,), generator=gen).tolist(),
                 frequency_penalty=0.3 + 0.1 * i, repetition_penalty=1.2) for i in range(9)]
    for step in range(40):
        start = (step * 3) % len(live)
        window = [live[(start + j) % len(live)] for j in range(1 + step % capacity)]
        logits = (torch.randn(len(window), vocab, generator=gen) * 3).to(device)
        got = state.apply(logits.clone(), window)
        torch.testing.assert_close(got, apply_penalties(logits.clone(), window),
                                   rtol=0, atol=1e-6)
        assert state.num_slots <= capacity and state.num_active <= capacity
        for r in window:
            r.append_output_token(int(torch.randint(0, vocab, (1,), generator=gen)))
    assert state.num_slots == capacity
    with pytest.raises(ValueError, match="capacity"):
        state.apply(torch.zeros(capacity + 1, vocab, device=device), live[:capacity + 1])


def test_penalty_state_memory_is_kept_out_of_the_kv_budget() -> None:
    """What the runner keeps aside for the penalty history is what the state can grow to."""
    from engine.penalties import PenaltyState

    state = PenaltyState(1000, torch.device("cpu"), capacity=3)
    reqs = [_req(f"r{i}", frequency_penalty=1.0) for i in range(3)]
    state.apply(torch.zeros(3, 1000), reqs)
    held = (state.counts.numel() * state.counts.element_size()
            + state.prompt_seen.numel() * state.prompt_seen.element_size())
    assert held == PenaltyState.bytes_for(3, 1000)


def test_sampler_penalizes_through_its_state() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, 4.95]])
    req = _req("r", prompt=[0], temperature=0.0, frequency_penalty=1.0)
    sampler = Sampler()
    tokens = []
    for _ in range(3):  # each chosen token is penalized on the next step
        token = sampler(logits.clone(), [req])[0][0]
        tokens.append(token)
        req.append_output_token(token)
    assert tokens == [0, 3, 1]
