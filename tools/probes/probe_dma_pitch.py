"""KV DMA copies on a cache whose planes lie more than 2 GiB apart (GPU).

`engine/dma_copy.py` moves a block as one 2-D copy whose pitch is a whole plane of the cache
(`num_blocks * block_plane_bytes`): 0.55 GB for an 8B cache at 40% of an H200, but a 1B model's
cache at 92% has planes of ~3.5 GB, and the runtime bounds a copy's pitch
(`cudaDevAttrMaxPitch`). This probe reads that bound and runs the three DMA copies (device to
device, device to pinned host, host to device) on a cache of 2 planes of `--plane-gib` each,
recording for each whether it ran and whether the bytes arrived.

Usage: PYTHONPATH=. python3 tools/probes/probe_dma_pitch.py --out F [--plane-gib 2.5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.results import git_info
from engine.dma_copy import _cudart, copy_blocks_dma, read_blocks_dma, write_blocks_dma

_DEV_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--plane-gib", type=float, default=2.5)
    args = p.parse_args()
    lib = _cudart()
    assert lib is not None, "no CUDA runtime to call"
    max_pitch = ctypes.c_int()
    assert lib.cudaDeviceGetAttribute(ctypes.byref(max_pitch), _DEV_ATTR_MAX_PITCH, 0) == 0
    block_shape = (16, 8, 128)  # bf16: 32 KiB of one block in one plane
    piece = 16 * 8 * 128 * 2
    num_blocks = int(args.plane_gib * 2**30) // piece
    cache = torch.zeros((1, 2, num_blocks, *block_shape), dtype=torch.bfloat16, device="cuda")
    ids, far = [1, 2, 5], [num_blocks - 1, num_blocks - 2, num_blocks - 7]
    blocks = torch.randn((len(ids), 1, 2, *block_shape), dtype=torch.bfloat16).pin_memory()
    side = torch.cuda.Stream()
    rows: dict[str, Any] = {}

    def case(name: str, run: Callable[[], None], check: Callable[[], bool]) -> None:
        try:
            run()
            side.synchronize()
            rows[name] = {"ran": True, "exact": bool(check())}
        except RuntimeError as exc:  # the runtime refused the copy
            rows[name] = {"ran": False, "error": str(exc)}
            torch.cuda.synchronize()

    case("write_host_to_device", lambda: write_blocks_dma(cache, ids, blocks, side),
         lambda: torch.equal(cache[:, :, ids].permute(2, 0, 1, 3, 4, 5).cpu(), blocks))
    case("copy_device_to_device", lambda: copy_blocks_dma(cache, far, cache, ids, [side]),
         lambda: torch.equal(cache[:, :, far], cache[:, :, ids]))
    back = torch.empty_like(blocks).pin_memory()
    case("read_device_to_host", lambda: read_blocks_dma(cache, ids, back, side),
         lambda: torch.equal(back, blocks))
    doc = {"max_pitch_bytes": max_pitch.value, "pitch_bytes": num_blocks * piece,
           "cases": rows, "gpu": torch.cuda.get_device_name(), "git": git_info(),
           "command": f"PYTHONPATH=. python3 tools/probes/probe_dma_pitch.py --plane-gib "
                      f"{args.plane_gib} --out F"}
    print(json.dumps(doc, indent=1))
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
