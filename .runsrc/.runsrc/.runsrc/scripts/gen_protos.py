"""Generate Python code (+ typed .pyi stubs) from protos/splitserve/v1/*.proto.

Usage: python scripts/gen_protos.py [--check]
--check regenerates into a temporary directory and fails when the committed files differ
(stale or hand-edited generated code).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "splitserve" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # imported here: only needed by this script

    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    # protoc finds the mypy plugins on PATH: put this interpreter's bin directory first.
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *[str(p.relative_to(ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out_dir = out_root / "protos" / "splitserve" / "v1"
    return sorted(p for p in out_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        if args.check:
            stale = [
                p.name for p in generated
                if not (PROTO_DIR / p.name).exists() or not filecmp.cmp(p, PROTO_DIR / p.name, shallow=False)
            ]
            committed = {p.name for p in PROTO_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
            extra = sorted(committed - {p.name for p in generated})
            if stale or extra:
                print(f"generated protos are stale: {stale + extra}; run python scripts/gen_protos.py",
                      file=sys.stderr)
                return 1
            print(f"protos up to date ({len(generated)} files)")
            return 0
        for p in generated:
            shutil.copyfile(p, PROTO_DIR / p.name)
        print(f"wrote {len(generated)} files to {PROTO_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
