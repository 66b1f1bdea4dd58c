"""Where a decode worker's CUDA IPC pulls spent their time, from its debug log.

`probe_disagg.py` workers log each pull at DEBUG (the `kv_transfer.connector` and `worker.kv`
loggers): `KV IPC load <id>: N blocks; lease .. ms, map .. ms, copy .. ms, release .. ms` and
`KV pull <id>: .. ms start to done`. This prints the stage medians of the measured c = 1
rounds, of the c = 16 round and of the ageing pulls.

Usage: python3 tools/gpu/summarize_pull_stages.py DECODE_LOG[.gz]
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
import sys
from pathlib import Path

_STAGES = re.compile(r"KV IPC load (\S+): (\d+) blocks; lease ([\d.]+) ms, map ([\d.]+) ms, "
                     r"copy ([\d.]+) ms, release ([\d.]+) ms")
_TOTAL = re.compile(r"KV pull (\S+): ([\d.]+) ms start to done")
_GROUPS = {"c1": re.compile(r"disaggregatedc1(_\d+)?-0"), "c16": re.compile(r"disaggregatedc16-\d+"),
           "age": re.compile(r"age-\d+")}


def summarize(text: str) -> dict[str, dict[str, float | int]]:
    stages = {m[1]: [float(x) for x in m.groups()[2:]] for m in _STAGES.finditer(text)}
    totals = {m[1]: float(m[2]) for m in _TOTAL.finditer(text)}
    out: dict[str, dict[str, float | int]] = {}
    for name, pattern in _GROUPS.items():
        ids = [i for i in stages if pattern.fullmatch(i)]
        if not ids:
            continue
        cols = list(zip(*(stages[i] for i in ids), strict=True))
        out[name] = {"pulls": len(ids), **{
            f"{stage}_ms": round(statistics.median(col), 2)
            for stage, col in zip(("lease", "map", "copy", "release"), cols, strict=True)},
            "start_to_done_ms": round(statistics.median(totals[i] for i in ids), 2)}
    return out


def main() -> int:
    path = Path(sys.argv[1])
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode()
    print(json.dumps(summarize(text), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
