"""Control for tests/test_kv_dma_copy.py's fence test: the same sequence without the fence."""
import torch

from engine import LLM

llm = LLM(model="dummy:tiny", dtype="bfloat16", max_model_len=256, enforce_eager=True,
          gpu_memory_utilization=0.05)
runner = llm.engine.runner
b = runner.kv_cache.shape[2] - 1
blocks = torch.randn((1, *runner.kv_shape_per_block), dtype=torch.bfloat16).pin_memory()
with torch.cuda.stream(runner.step_stream or torch.cuda.current_stream()):
    torch.cuda._sleep(200_000_000)
    runner.kv_cache[:, :, b].fill_(0)
runner.write_blocks([b], blocks)  # no fence_kv_loads()
torch.cuda.synchronize()
print("without the fence the load survived the stale write:",
      torch.equal(runner.kv_cache[:, :, b].cpu(), blocks[0]))
