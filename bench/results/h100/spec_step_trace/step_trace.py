"""The GPU speculation probe (tools/probes/probe_spec_policy_gpu.py) with every step the
worker's step-cost model times logged (see README.md in this folder): the run it belongs to
(its requests' id prefix), query rows (a verify graph's padded rows), sequences, drafts, KV
tokens, seconds, whether the step overlapped the next one's launch, and the host time the
call spent drafting (the proposer and shadow drafts).

    PYTHONPATH=. python3 bench/results/h100/spec_step_trace/step_trace.py OUT_DIR [probe flags]
"""

import json
import sys
import time
from pathlib import Path
from typing import Any

from engine.llm_engine import LLMEngine, _decode_rows
from engine.scheduler import SchedulerOutput
from tools.probes import probe_spec_policy_gpu as probe

steps: list[dict[str, Any]] = []
_record = LLMEngine._record_step_cost
_propose = LLMEngine._propose
drafting_s = [0.0]


def propose(self: LLMEngine, reqs: Any) -> None:
    t = time.perf_counter()
    _propose(self, reqs)
    drafting_s[0] += time.perf_counter() - t


def record(self: LLMEngine, out: SchedulerOutput, settled: SchedulerOutput | None,
           seconds: float) -> None:
    timed = self._timed_step(out, settled)
    if timed is not None and _decode_rows(timed) is not None:
        first = timed.scheduled[0].request.request_id
        steps.append({
            "run": first.rsplit("-", 1)[0], "rows": _decode_rows(timed),
            "padded": timed.padded_rows, "seqs": len(timed.scheduled),
            "drafts": sum(len(s.draft_token_ids) for s in timed.scheduled),
            "kv": sum(s.num_computed_tokens + s.num_new_tokens for s in timed.scheduled),
            "ms": round(seconds * 1e3, 3), "async": timed is settled,
            "drafting_ms": round(drafting_s[0] * 1e3, 3)})
    drafting_s[0] = 0.0
    _record(self, out, settled, seconds)


def main() -> int:
    out_dir = Path(sys.argv[1])
    LLMEngine._record_step_cost = record  # type: ignore[method-assign]
    LLMEngine._propose = propose  # type: ignore[method-assign]
    try:
        return probe.main(["--out", str(out_dir / "spec_policy.json"), *sys.argv[2:]])
    finally:
        (out_dir / "steps.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    sys.exit(main())
