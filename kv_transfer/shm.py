"""Shared-memory segments for KV handoff between workers on one host (`PullBlocksShm`).

The puller creates a segment under /dev/shm (mode 0600: only the workers' user can open it),
the prefill worker writes the blocks' raw bytes into it, the puller copies them into its cache
and unlinks it. Plain `os.open` + `mmap` rather than `multiprocessing.shared_memory`, whose
resource tracker would unlink segments that another process opened (before Python 3.13).
Names are random and carry a fixed prefix, so the server opens nothing but such segments.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets

import torch

SHM_DIR = "/dev/shm"
SHM_PREFIX = "splitserve-kv-"
_NAME = re.compile(rf"^{SHM_PREFIX}[0-9a-f]{{32}}$")


class ShmError(Exception):
    """A segment could not be created, opened or does not have the expected size."""


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


class ShmSegment:
    """A mapped segment; `close()` unmaps it (and unlinks it when this side created it)."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        if not valid_name(name):
            raise ShmError(f"not a KV segment name: {name!r}")
        if size <= 0:
            raise ShmError(f"segment size must be > 0, got {size}")
        self.name = name
        self.size = size
        self._owner = create
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise ShmError(f"cannot {'create' if create else 'open'} {path}: {exc}") from exc
        try:
            if create:
                # Allocated now, not on first write: a tmpfs without room for it (a container's
                # 64 MB /dev/shm) fails here with ENOSPC instead of killing the writer with
                # SIGBUS later.
                os.posix_fallocate(fd, 0, size)
            elif os.fstat(fd).st_size != size:
                raise ShmError(f"{path} has {os.fstat(fd).st_size} bytes, expected {size}")
            self._map = mmap.mmap(fd, size)
        except OSError as exc:
            if create:
                os.unlink(path)
            raise ShmError(f"cannot map {path}: {exc}") from exc
        finally:
            os.close(fd)

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        return cls(SHM_PREFIX + secrets.token_hex(16), size, create=True)

    @classmethod
    def open(cls, name: str, size: int) -> ShmSegment:
        return cls(name, size, create=False)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The segment as a CPU tensor (sharing its memory: drop it before `close`)."""
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        if self._map.closed:
            return
        # BufferError: a tensor still views it; unmapped when the last one goes.
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
