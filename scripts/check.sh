#!/usr/bin/env bash
# The project's checks: generated protos up to date, ruff, mypy, the import contracts (the layers
# in pyproject.toml's [tool.importlinter]), the gateway importing without the workers' packages
# (scripts/check_gateway_imports.py), then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

echo "== protos"; "$PY" scripts/gen_protos.py --check
echo "== ruff"; "$PY" -m ruff check .
echo "== import contracts"; "$(dirname "$PY")/lint-imports" --no-cache
echo "== gateway-only imports"; "$PY" scripts/check_gateway_imports.py
echo "== mypy"; "$PY" -m mypy splitserve prefill_service decode_service gateway worker kv_transfer engine engine_api rpc bench tools
[ "${1:-}" = "--lint-only" ] && exit 0
# The machine the suite ran on, printed last (also after a failure) so a slow or failing run
# can be compared with others: CPUs visible and usable (affinity, cgroup quota), load.
machine() {
  "$PY" -c 'import os, torch; from engine_api.cpus import available_cpus, cgroup_cpu_limit
print(f"== machine: cpu_count={os.cpu_count()} usable={available_cpus()} "
      f"cgroup_limit={cgroup_cpu_limit()} torch_threads={torch.get_num_threads()} "
      f"load={os.getloadavg()}")' || true
}
trap machine EXIT
echo "== pytest"; "$PY" -m pytest -q -p no:cacheprovider --durations=25 "$@"
