"""A request's greedy output does not depend on what it is batched with, nor on being preempted
and recomputed (float32 on the CPU)."""

from __future__ import annotations

from pathlib import Path

from engine.llm import LLM
from tests.support.engine_driver import greedy, tiny_llm

TARGET = "Write one sentence about the sea."
OTHERS = [
    "Hi", "List three colours.", "What is 2 + 2?",
    "Explain photosynthesis to a child in simple words, please.", "Name a planet.",
    "Translate 'good morning' into French.", "Why is the sky blue?", "Count from one to five.",
    "Give me a synonym for happy.", "What does a cat say?",
    "Describe a rainy afternoon in a small town, with the smell of wet stone and bread.",
    "Who wrote Hamlet?", "Spell the word 'cat'.", "Is water wet?", "Say something kind.",
]


def _outputs(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n))
    return [o.outputs[0].token_ids for o in outs]


def test_smollm2_output_independent_of_batch(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    target = tok.encode(TARGET)
    others = [tok.encode(t) for t in OTHERS]
    assert len({len(p) for p in others}) > 5  # different lengths
    n = 8
    [alone] = _outputs(smollm2, [target], n)
    with3 = _outputs(smollm2, [others[0], target, others[1], others[2]], n)
    with15 = _outputs(smollm2, [*others[:7], target, *others[7:]], n)
    assert with3[1] == alone
    assert with15[7] == alone
    assert len(set(alone)) > 1
    assert len({tuple(o) for o in with15}) > 8, "outputs look degenerate"
    # The others are batch-invariant too (alone vs. inside the 16-request batch).
    for i in (0, 3, 10):
        assert _outputs(smollm2, [others[i]], n)[0] == with15[i if i < 7 else i + 1]
    eng = smollm2.engine
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_output_survives_preemption(tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs["llama"]
    prompts = [[(7 * i + 3 * j) % 384 for j in range(6 + i)] for i in range(8)]
    n = 12
    roomy = tiny_llm(path, max_num_batched_tokens=16)
    want = _outputs(roomy, prompts, n)
    [alone] = _outputs(roomy, [prompts[5]], n)
    assert roomy.engine.scheduler.num_preemptions == 0
    assert alone == want[5]
    assert len({t for o in want for t in o}) > 10, "outputs look degenerate"
    # 12 blocks of 4 = 48 slots for 8 requests of up to 25 tokens: preemption is forced, and
    # the biggest request (7 blocks) still fits alone.
    tight = tiny_llm(path, max_num_batched_tokens=16, num_gpu_blocks=12)
    got = _outputs(tight, prompts, n)
    sched = tight.engine.scheduler
    assert sched.num_preemptions > 0
    assert got == want
    sched.check_integrity()
    assert tight.engine.kv.num_free_blocks == 12
