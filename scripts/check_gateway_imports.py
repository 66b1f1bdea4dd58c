"""A gateway-only install has no torch, triton, transformers, xgrammar, safetensors or redis
(the `workers` extra brings them): import every module a gateway process and the torch-free CLI
commands load with those packages made unimportable, so a stray import fails here, not in a
slim gateway image. Run by scripts/check.sh (`make test`)."""

from __future__ import annotations

import importlib
import importlib.abc
import sys

WORKER_ONLY = ("torch", "triton", "transformers", "xgrammar", "safetensors", "redis")
GATEWAY_MODULES = ("gateway.server", "gateway.openai_api", "gateway.grpc_server",
                   "splitserve.cli", "splitserve.serve", "splitserve.up", "splitserve.health",
                   "bench.online", "bench.cli")


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name.split(".")[0] in WORKER_ONLY:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: a gateway-only "
                                      "install lacks it)", name=name)
        return None


def main() -> int:
    for name in WORKER_ONLY:
        sys.modules.pop(name, None)
    sys.meta_path.insert(0, _Blocked())
    failed = []
    for module in GATEWAY_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as err:
            failed.append(f"{module}: {err}")
    for line in failed:
        print(f"gateway-only import failed: {line}", file=sys.stderr)
    if not failed:
        print(f"gateway-only imports ok ({len(GATEWAY_MODULES)} modules without "
              f"{', '.join(WORKER_ONLY)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
